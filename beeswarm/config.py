"""Where beeswarm keeps its files, with BEESWARM_* environment overrides."""
from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP = "beeswarm"


def config_dir() -> Path:
    """Identity and secret fallbacks live here (BEESWARM_CONFIG_DIR overrides)."""
    return Path(os.environ.get("BEESWARM_CONFIG_DIR") or platformdirs.user_config_path(APP))


def cache_dir() -> Path:
    """Benchmark results and downloads (BEESWARM_CACHE_DIR overrides)."""
    return Path(os.environ.get("BEESWARM_CACHE_DIR") or platformdirs.user_cache_path(APP))
