"""Every environment variable hybridmoe reads, read here and nowhere else."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """HYBRIDMOE_CACHE_DIR, else $XDG_CACHE_HOME/hybridmoe, else ~/.cache/hybridmoe."""
    explicit = os.environ.get("HYBRIDMOE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "hybridmoe"


def hybrid_overlap() -> bool:
    """HYBRIDMOE_HYBRID_OVERLAP=0 serialises the hybrid CPU wait before the accelerator work
    (a measurement switch; the config field `overlap` is the normal way)."""
    return os.environ.get("HYBRIDMOE_HYBRID_OVERLAP", "1") != "0"
