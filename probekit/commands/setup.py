"""``probekit setup``: prepare the offline assets (docs/commands/setup.md)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from probekit.commands.common import say


@dataclasses.dataclass(frozen=True)
class Config:
    """Set up NLTK's English part-of-speech tagger offline (converted from the
    textblob-aptagger wheel); idempotent. Guide: docs/commands/setup.md."""

    data_dir: Path | None = None
    """probekit data dir (default: $PROBEKIT_DATA_DIR or the platform's user data dir)"""


def run(config: Config) -> int:
    from probekit.data.postag import ensure_tagger

    root = ensure_tagger(config.data_dir)
    say(f"NLTK tagger and universal tagset map ready in {root}")
    return 0
