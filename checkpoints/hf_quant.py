"""GPTQ and AWQ checkpoints (`quantization_config.quant_method` "gptq" / "awq"): their packed
4-bit linear weights repacked once at load into the int4 layout (`checkpoints.quantize`), 8-bit
GPTQ ones into int8, never through float32.

1. `packed_scheme(config)` reads the HF config's `quantization_config`: None without one; a
   `PackedScheme` for 4- and 8-bit GPTQ (checkpoint_format "gptq" or "gptq_v2") and 4-bit AWQ
   "gemm"; anything else raises `CheckpointError` naming the method / field it refuses.
2. `PackedView(ckpt, scheme)` shows the checkpoint under plain names: the tensors `X.qweight`,
   `X.qzeros`, `X.scales` (and GPTQ's `X.g_idx`) of a packed linear are listed once, as
   `X.weight`; `quantized(name, fmt, groups)` returns that weight as (codes uint4[out, in], scale
   f16[out, G], offset f16[out, G]) in HF's [out, in] layout, 8-bit as (codes int8[out, in] =
   code - zero, scale f32[out, G]: exact, refused by name where a zero point leaves a code
   outside int8's range); act-order ones as `Permuted(those parts, perm)` (`None` for every other tensor,
   which `tensor` reads as stored); `tensor(name)` of a packed weight refuses (it would mean a
   float copy).
3. Layouts (K = in_features, N = out_features, g = group_size, value = (code - zero) * scale;
   ours: code * scale + offset with offset = -zero * scale; the checkpoint's f16 scale is kept
   exactly, the offset is rounded to f16 (a 4-bit zero times an 11-bit scale needs up to 15
   significant bits, f16 holds 11: each value moves by at most 2^-11 * zero * scale <= scale /
   128, 1/128 of a quantization step, against the 1/2 step of the 4-bit rounding itself):
   - GPTQ (b bits, f = 32 / b fields a word): qweight i32[K / f, N], input row k's code in bits
     b (k % f) .. of qweight[k // f, n]; qzeros i32[K / g, N / f], column n's zero in bits
     b (n % f) .. of qzeros[., n // f], stored
     minus one by checkpoint_format "gptq" (v1), as is by "gptq_v2"; scales f16[K / g, N]; g_idx
     i32[K], each input row's group: k // g, except under desc_act (act-order), where the rows of
     a group are wherever GPTQ's column order put them. Those load with the rows sorted by group
     (a stable argsort of g_idx: then consecutive groups of g rows, checked) and the permutation
     returned beside the parts (`quantize.Permuted`; the format gains "-act", the weight a
     `QArray.perm` through which the model gathers x). g_idx not k // g without desc_act, or
     groups of other than g rows, are refused by name.
   - AWQ (GEMM): qweight i32[K, N / 8] and qzeros i32[K / g, N / 8]: 8 columns per int32, column
     8 j + AWQ_ORDER[i] in bits 4 i of word j; scales f16[K / g, N].
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from checkpoints import quantize as qlib
from checkpoints.errors import CheckpointError

# AWQ's GEMM packing: the column held by each 4-bit slot of a word (slot i -> column AWQ_ORDER[i]).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PACKED_PARTS = ("qweight", "qzeros", "scales", "g_idx")


@dataclasses.dataclass(frozen=True)
class PackedScheme:
    method: str  # "gptq" | "awq"
    group_size: int  # input channels per scale group (-1 in the config: all K)
    zero_offset: int  # added to the stored zeros (GPTQ v1: 1)
    bits: int = 4  # 4 (int4) or 8 (GPTQ only: int8)
    act_order: bool = False  # GPTQ desc_act: input rows in groups by g_idx, loaded permuted

    @property
    def fmt(self) -> str:
        """The base format its linears load as."""
        return "int8" if self.bits == 8 else "int4"


def packed_scheme(config: dict[str, Any]) -> PackedScheme | None:
    """The packed 4-bit scheme of a HF config, None when it has no `quantization_config`."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in ("gptq", "awq"):
        raise CheckpointError(
            f"quantization_config.quant_method={method!r} is not supported (supported: 'gptq' "
            "and 'awq', 4-bit)"
        )
    bits = qc.get("bits", qc.get("w_bit"))
    if bits not in ((4, 8) if method == "gptq" else (4,)):
        supported = "4 and 8" if method == "gptq" else "only 4"
        raise CheckpointError(
            f"quantization_config.bits={bits!r} ({method}): {supported} supported"
        )
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise CheckpointError(
                f"quantization_config.version={version!r} (awq): only 'gemm' is supported"
            )
        if qc.get("zero_point", True) is False:
            raise CheckpointError("quantization_config.zero_point=False (awq) is not supported")
        return PackedScheme("awq", group, 0)
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise CheckpointError(
            f"quantization_config.checkpoint_format={fmt!r} (gptq): only 'gptq' and 'gptq_v2'"
        )
    act = bool(qc.get("desc_act", False))
    return PackedScheme("gptq", group, 1 if fmt == "gptq" else 0, bits, act)


def _fields(words: np.ndarray, axis: int, bits: int = 4) -> np.ndarray:
    """u8 codes of i32 `words`, each word's 32 / `bits` fields (lowest first) along `axis`."""
    per = 32 // bits
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    w = np.asarray(words).astype(np.uint32)
    mask = np.uint32((1 << bits) - 1)
    parts = np.expand_dims(w, axis + 1) >> shifts.reshape((per,) + (1,) * (w.ndim - axis - 1))
    shape = list(w.shape)
    shape[axis] *= per
    return (parts & mask).astype(np.uint8).reshape(shape)


class PackedView:
    """A HF checkpoint of GPTQ / AWQ packed linears under plain names (module docstring, step 2)."""

    def __init__(self, ckpt: Any, scheme: PackedScheme) -> None:
        self.ckpt, self.scheme = ckpt, scheme
        self.config = ckpt.config
        self._packed = {
            n.removesuffix(".qweight") for n in ckpt.tensor_names() if n.endswith(".qweight")
        }

    def tensor_names(self) -> list[str]:
        names = []
        for n in self.ckpt.tensor_names():
            base, _, part = n.rpartition(".")
            if base in self._packed and part in PACKED_PARTS:
                if part == "qweight":
                    names.append(base + ".weight")
            else:
                names.append(n)
        return names

    def tensor(self, name: str) -> np.ndarray:
        if name.removesuffix(".weight") in self._packed:
            raise CheckpointError(
                f"{name!r} is a packed {self.scheme.method} weight: it loads with "
                f"quantization={self.scheme.fmt!r} only (no float copy)"
            )
        return self.ckpt.tensor(name)

    def quantized(self, name: str, fmt: str, groups: int) -> tuple[np.ndarray, ...] | None:
        base = name.removesuffix(".weight")
        if base not in self._packed:
            return None
        if qlib.base_format(fmt) != self.scheme.fmt:
            raise CheckpointError(
                f"{name!r}: a packed {self.scheme.method} weight loads as {self.scheme.fmt}"
            )
        codes, scale, zero, perm = self._unpack(base)  # [K, N], f32[G, N], f32[G, N], i32[K]
        if scale.shape[0] != groups:
            raise CheckpointError(
                f"{name!r}: {scale.shape[0]} scale groups in the checkpoint, {groups} expected"
            )
        if self.scheme.bits == 8:  # int8: code - zero as stored, the f16 scale widened exactly
            size = codes.shape[0] // groups
            ints = codes.astype(np.int32) - np.repeat(zero, size, axis=0).astype(np.int32)
            if ints.min(initial=0) < -128 or ints.max(initial=0) > 127:
                raise CheckpointError(
                    f"{name!r}: 8-bit {self.scheme.method} zero points leave codes outside int8 "
                    f"({int(ints.min())}..{int(ints.max())}); only symmetric (zero 128) ones load"
                )
            return self._with_perm((ints.astype(np.int8).T, scale.T), perm)
        f16 = qlib.SCALE_DTYPE["int4"]
        parts = (
            codes.astype(qlib.STORAGE["int4"]).T,
            scale.astype(f16).T,
            (-zero * scale).astype(f16).T,
        )
        return self._with_perm(parts, perm)

    def _with_perm(self, parts: tuple, perm: np.ndarray | None) -> Any:
        """`parts` as they are, or with act-order their input rows' permutation (`Permuted`)."""
        if not self.scheme.act_order:
            return parts
        k = parts[0].shape[1]
        return qlib.Permuted(parts, np.arange(k, dtype=np.int32) if perm is None else perm)

    def _unpack(self, base: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        get = self.ckpt.tensor
        scale = np.asarray(get(base + ".scales"), np.float32)  # [G, N]
        perm = None
        if self.scheme.method == "awq":
            order = np.argsort(AWQ_ORDER)  # column c sits in slot order[c]

            def cols(words: np.ndarray) -> np.ndarray:
                raw = _fields(words, 1)  # [.., N] in slot order within each 8 columns
                return raw.reshape(raw.shape[0], -1, 8)[:, :, order].reshape(raw.shape)

            codes, zeros = cols(get(base + ".qweight")), cols(get(base + ".qzeros"))
        else:
            codes = _fields(get(base + ".qweight"), 0, self.scheme.bits)  # [K, N]
            zeros = _fields(get(base + ".qzeros"), 1, self.scheme.bits)  # [G, N]
            if base + ".g_idx" in self.ckpt:
                perm = self._act_order(base, np.asarray(get(base + ".g_idx")), scale.shape[0])
                codes = codes if perm is None else codes[perm]
        zero = zeros[:, : scale.shape[1]].astype(np.float32) + np.float32(self.scheme.zero_offset)
        return codes, scale, zero, perm

    def _act_order(self, base: str, g_idx: np.ndarray, groups: int) -> np.ndarray | None:
        """The permutation that sorts a GPTQ weight's input rows into consecutive groups by its
        `g_idx` (None: they are already); refused by name when `desc_act` is false or a group
        does not hold exactly K / G rows."""
        k = g_idx.shape[0]
        size = k // groups
        if np.array_equal(g_idx, np.arange(k) // size):
            return None
        if not self.scheme.act_order:
            raise CheckpointError(
                f"{base}.g_idx: groups that are not consecutive rows, but the config's "
                "quantization_config.desc_act is false"
            )
        perm = np.argsort(g_idx, kind="stable").astype(np.int32)
        if not np.array_equal(g_idx[perm], np.arange(k) // size):
            raise CheckpointError(
                f"{base}.g_idx: act-order groups of other than {size} rows each (desc_act=True "
                "loads groups of group_size rows, permuted)"
            )
        return perm

    def close(self) -> None:
        self.ckpt.close()
