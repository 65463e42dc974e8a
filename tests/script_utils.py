"""A script of `scripts/` imported as a module (the scripts are not a package)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = str(Path(__file__).resolve().parents[1] / "scripts")


def script(name: str) -> ModuleType:
    """`scripts/<name>.py` as a module, `scripts/` on the path only while it is imported."""
    sys.path.insert(0, SCRIPTS)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(SCRIPTS)
