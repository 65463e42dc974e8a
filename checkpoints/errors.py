"""The one error type every checkpoint loader raises.

1. A loader (`hf.py`, `gguf.py`, `orbax_io.py`, ...) finds something wrong with a checkpoint on
   disk or with the tree it is asked to fill: a missing or unreadable file, a corrupted header, a
   tensor the index promises but the shard lacks, a leaf whose shape does not match.
2. It raises `CheckpointError` with a message naming the offending file, tensor or leaf path, so
   callers can catch one type for "this checkpoint is unusable" and show the message as is.

`GGUFError` is the GGUF reader's and dequantizers' (`gguf.py`, `gguf_quants.py`) subclass.

NOTE: `CheckpointError` subclasses `ValueError`: a bad checkpoint is bad input, not a bug.
"""


class CheckpointError(ValueError):
    """A checkpoint on disk is missing, malformed, or does not match what was asked of it."""


class GGUFError(CheckpointError):
    """A GGUF file that cannot be read as a supported checkpoint: the message names the problem.

    A `CheckpointError`, hence a `ValueError`.
    """
