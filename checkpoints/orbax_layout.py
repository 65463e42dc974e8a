"""Where an orbax checkpoint written by `orbax_io.save_params` keeps its params, and how to tell a
finished one (no JAX or Orbax imported: a serving front end recognises the source with it).

1. `PARAMS_DIR` is the params checkpoint's directory under the checkpoint dir.
2. `ORBAX_MARKERS` are the files Orbax always writes into a finished `StandardCheckpointer`
   checkpoint; `is_orbax_checkpoint(path)` is True when every one is there.
"""

from __future__ import annotations

import os
from pathlib import Path

PARAMS_DIR = "params"
ORBAX_MARKERS = ("_CHECKPOINT_METADATA", "_METADATA")


def is_orbax_checkpoint(path: str | os.PathLike) -> bool:
    """True when `path` holds a finished checkpoint written by `save_params`."""
    params_dir = Path(path) / PARAMS_DIR
    return all((params_dir / marker).is_file() for marker in ORBAX_MARKERS)
