"""Where probekit keeps files outside the repository: one place for every folder.

- cache (``$PROBEKIT_CACHE_DIR`` or ``platformdirs.user_cache_dir("probekit")``):
  dequantised models, tokenizers, the parsed Wikipedia corpus. Safe to delete.
- data (``$PROBEKIT_DATA_DIR`` or ``platformdirs.user_data_dir("probekit")``): the offline
  NLTK tagger files that ``probekit setup`` writes.
- runs (``runs/`` under the working directory): run directories of commands.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

RUNS_ROOT = Path("runs")


def cache_dir() -> Path:
    """Root of probekit's cache: ``$PROBEKIT_CACHE_DIR`` or the platform user cache dir."""
    return Path(os.environ.get("PROBEKIT_CACHE_DIR") or platformdirs.user_cache_dir("probekit"))


def data_dir() -> Path:
    """probekit's data directory: ``$PROBEKIT_DATA_DIR`` or the platform user data dir."""
    return Path(os.environ.get("PROBEKIT_DATA_DIR") or platformdirs.user_data_dir("probekit"))
