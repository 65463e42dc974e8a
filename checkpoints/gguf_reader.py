"""`BoundedReader`: gguf-py's `GGUFReader` with its reads bounded by the file size and its
metadata arrays parsed in one pass.

1. Every header read (`_get`) and every tensor's byte range (`_build_tensors`) is checked against
   the file size first: a truncated file raises `Problem` naming what it cut.
2. A metadata array of strings or scalars (the tokenizer's 49K tokens, merges and token types)
   is parsed in one pass over the memory map (`_get_field_parts`), into the same `ReaderField`
   parts gguf-py builds element by element (one numpy view per element: ~10 s of a restart's
   model load on the 2-core machine, BENCHMARKS.md "Restarts").
"""

from __future__ import annotations

import math
import struct
from typing import Any

import gguf
import numpy as np

from checkpoints.gguf_quants import GGMLType, _type_name

_U64 = struct.Struct("=Q")  # native, as the reader's byte_order "I"


class Problem(Exception):
    """Raised inside the reader; read_gguf() turns it into a GGUFError naming the file."""


class BoundedReader(gguf.GGUFReader):
    """gguf.GGUFReader that checks sizes before it slices the memory map.

    NOTE: `_get` and `_build_tensors` are internals of gguf-py (0.19); if they change, failures
    still surface as GGUFError through read_gguf's catch-all, only with a vaguer message.
    """

    def _get(self, offs: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        end = int(offs) + np.dtype(dtype).itemsize * int(count)
        if end > len(self.data):
            raise Problem(
                f"truncated: the header needs bytes up to {end} but the file has {len(self.data)}"
            )
        # NOTE: gguf-py's `_get` on a plain ndarray view: np.memmap slices tripled the header's CPU
        arr = self.data.view(np.ndarray)[int(offs) : end].view(dtype)[: int(count)]
        return arr.view(arr.dtype.newbyteorder(override_order or self.byte_order))

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        for field in fields:
            dims, raw_type, rel_offset = field.parts[3], field.parts[4], field.parts[5]
            try:
                qtype = GGMLType(int(raw_type[0]))
            except ValueError:
                raise Problem(f"tensor {field.name!r} has {_type_name(raw_type[0])}") from None
            block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            ne = [int(x) for x in dims]
            if ne and ne[0] % block_size:
                raise Problem(
                    f"tensor {field.name!r} ({qtype.name}, ne={ne}) has rows that are not a "
                    f"multiple of the block size {block_size}"
                )
            start = int(start_offs) + int(rel_offset[0])
            end = start + math.prod(ne) // block_size * block_bytes
            if end > len(self.data):
                raise Problem(
                    f"truncated: tensor {field.name!r} ({qtype.name}, ne={ne}) occupies bytes "
                    f"[{start}, {end}) but the file has {len(self.data)}"
                )
        super()._build_tensors(start_offs, fields)

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list, list]:
        if raw_type != gguf.GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        n, offs = int(alen[0]), orig_offs + 12
        itype = gguf.GGUFValueType(int(raw_itype[0]))
        nptype = self.gguf_scalar_to_np.get(itype)
        if itype != gguf.GGUFValueType.STRING and nptype is None:  # arrays of arrays
            return super()._get_field_parts(orig_offs, raw_type)
        data = self.data.view(np.ndarray)
        parts: list[Any] = [raw_itype, alen]
        if nptype is not None:
            size = np.dtype(nptype).itemsize * n
            self._get(offs, np.uint8, size)  # bounds
            parts += list(data[offs : offs + size].view(nptype).reshape(n, 1))
            offs += size
        else:
            buf, end = memoryview(data), len(data)
            for _ in range(n):
                if offs + 8 > end:
                    self._get(offs, np.uint64)  # raises: truncated
                (length,) = _U64.unpack_from(buf, offs)
                if offs + 8 + length > end:
                    self._get(offs + 8, np.uint8, length)  # raises: truncated
                parts += (data[offs : offs + 8].view(np.uint64), data[offs + 8 : offs + 8 + length])
                offs += 8 + length
        idxs = list(range(2, len(parts))) if nptype is not None else list(range(3, len(parts), 2))
        return offs - orig_offs, parts, idxs, [gguf.GGUFValueType.ARRAY, itype][: 1 + (n > 0)]


__all__ = ["BoundedReader", "Problem"]
