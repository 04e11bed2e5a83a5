"""``probekit setup``: prepare the offline assets (docs/commands/setup.md)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from probekit.commands.common import UsageError, say
from probekit.validation import check_fields


@dataclasses.dataclass(frozen=True)
class Config:
    """Set up NLTK's English part-of-speech tagger offline (converted from the
    textblob-aptagger wheel); idempotent. Guide: docs/commands/setup.md."""

    data_dir: Path | None = None
    """probekit data dir (default: $PROBEKIT_DATA_DIR or the platform's user data dir)"""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.data_dir is not None and self.data_dir.exists() and not self.data_dir.is_dir():
            raise UsageError(f"--data-dir {self.data_dir} is a file; give a folder")


def run(config: Config) -> int:
    from probekit.data.postag import ensure_tagger

    root = ensure_tagger(config.data_dir)
    say(f"NLTK tagger and universal tagset map ready in {root}")
    return 0
