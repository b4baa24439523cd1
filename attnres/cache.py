"""Where attnres keeps what it builds once per machine: compiled kernels, trained tokenizers."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$ATTNRES_CACHE_DIR``, else ``$XDG_CACHE_HOME/attnres``, else ``~/.cache/attnres``."""
    if os.environ.get("ATTNRES_CACHE_DIR"):
        return Path(os.environ["ATTNRES_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "attnres"
