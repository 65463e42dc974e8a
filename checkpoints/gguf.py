"""GGUF checkpoints (llama.cpp's single-file format) read as Hugging Face names, layouts and config.

Flow:
1. `read_gguf(path)` checks the file exists and starts with the `GGUF` magic, then parses the
   container with `gguf.GGUFReader`. The reader memory-maps the file, so no tensor bytes are read
   yet; a bounded subclass (`gguf_reader.BoundedReader`) checks every header read and every
   tensor's byte range against the file size first, so a truncated file fails naming the tensor
   instead of deep inside numpy, and parses the metadata arrays (the tokenizer's) in one pass.
2. The key/value metadata becomes plain Python values (arrays become lists, tokenizer arrays too).
3. Every GGUF tensor name is mapped once, up front, to its HF name for the file's architecture
   (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`) by the `gguf` library's
   tensor-name map (`_names`); an unknown name, an unsupported architecture or an unsupported
   quantization type fails here, naming it.
4. `GGUFCheckpoint.tensor(hf_name)` dequantizes that one tensor from the memory map
   (`gguf_quants.dequantize`) into float32, then undoes what llama.cpp's converter changed:
   the rotary row permutation of Q/K for the `llama` architecture, and the `+1` it folds into
   Gemma's RMSNorm weights. The result equals the HF checkpoint's tensor (up to quantization).
5. `GGUFCheckpoint.quantized(hf_name, fmt, groups)` is the loader's path when `quantization` is
   set: a block-quantized tensor requantized to int8 / fp8 with `groups` scales per row, a chunk
   of rows at a time (`gguf_quants.requantize`; exactly, by folding the block scales, for the
   symmetric formats where a group's block scales allow it); int4 gives (codes, scales, offsets),
   Q4_0 / Q4_1 exactly and Q4_K to one f16 rounding of its sub-block scales, in groups of 32
   (`gguf_quants.requantize4`, `native_int4_groups`); a file of symmetric blocks only (Q8_0,
   Q4_0, Q5_0, Q6_K) loads int8 exactly in groups of its blocks (`native_int8_groups`).
6. `GGUFCheckpoint.hf_config()` derives a HF `config.json`-style dict from the metadata.

Layout: GGUF lists dimensions fastest first (`ne[0]` is the contiguous one), so the numpy shape is
the reversed GGUF shape, which for a linear layer is HF's `[out, in]`. Quantized types pack each
row of `ne[0]` values into blocks of 32 or 256 values (`gguf.GGML_QUANT_SIZES` gives the block
size and its byte count).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np

from checkpoints.errors import GGUFError
from checkpoints.gguf_quants import (
    _FLOAT_TYPES,
    _NATIVE4,
    NATIVE4_GROUP,
    SUPPORTED_TYPES,
    SYMMETRIC_BLOCK,
    GGMLType,
    dequantize,
    requantize,
    requantize4,
)
from checkpoints.gguf_reader import BoundedReader, Problem

_GGUF_MAGIC = b"GGUF"


@dataclasses.dataclass(frozen=True)
class _Arch:
    """How one GGUF `general.architecture` maps onto its HF model (tensor names: `_names`)."""

    hf_class: str
    biases: frozenset[str]  # GGUF parts that may carry a .bias
    permute_qk: bool  # llama.cpp interleaved the rotary halves of Q/K rows
    norm_offset: float  # llama.cpp stored RMSNorm weights as (w + norm_offset)
    hidden_act: str


_ATTN_BIASES = frozenset({"attn_q", "attn_k", "attn_v", "attn_output"})
_ARCHS: dict[str, _Arch] = {
    # Mistral checkpoints are stored by llama.cpp as `llama` too.
    "llama": _Arch(
        "LlamaForCausalLM",
        _ATTN_BIASES | {"ffn_gate", "ffn_up", "ffn_down"},
        permute_qk=True,
        norm_offset=0.0,
        hidden_act="silu",
    ),
    "qwen2": _Arch(
        "Qwen2ForCausalLM",
        frozenset({"attn_q", "attn_k", "attn_v"}),
        permute_qk=False,
        norm_offset=0.0,
        hidden_act="silu",
    ),
    "qwen3": _Arch(
        "Qwen3ForCausalLM", _ATTN_BIASES, permute_qk=False, norm_offset=0.0, hidden_act="silu"
    ),
    "gemma": _Arch(
        "GemmaForCausalLM",
        _ATTN_BIASES,
        permute_qk=False,
        norm_offset=1.0,
        hidden_act="gelu_pytorch_tanh",
    ),
    "gemma2": _Arch(
        "Gemma2ForCausalLM",
        _ATTN_BIASES,
        permute_qk=False,
        norm_offset=1.0,
        hidden_act="gelu_pytorch_tanh",
    ),
}
# The HF tensor names (per layer: under model.layers.N.) our dense families read. Which GGUF name
# each has in an architecture (or none) is the `gguf` library's tensor-name map's answer: e.g.
# `post_attention_layernorm` is `ffn_norm` in llama but `post_attention_norm` in gemma2.
_HF_LAYER_NAMES = (
    "input_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)
_HF_GLOBAL_NAMES = ("model.embed_tokens", "model.norm", "lm_head")


@functools.cache
def _names(arch: str) -> tuple[dict[str, str], dict[str, str]]:
    """(GGUF per-layer part -> HF name under model.layers.N., GGUF global -> HF name) of `arch`,
    from `gguf.get_tensor_name_map` (HF -> GGUF) inverted over the names our families read."""
    model_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    tmap = gguf.get_tensor_name_map(model_arch, 1)
    layer, global_ = {}, {}
    for hf in _HF_LAYER_NAMES:
        if (name := tmap.get_name(f"model.layers.0.{hf}")) is not None:
            layer[name.removeprefix("blk.0.")] = hf
    for hf in _HF_GLOBAL_NAMES:
        if (name := tmap.get_name(hf)) is not None:
            global_[name] = hf
    return layer, global_


_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_TENSOR = re.compile(r"(\w+)\.(weight|bias)")
# llama.cpp's per-dimension rotary frequency divisors for Llama 3.x rope scaling: not an HF
# parameter, it becomes `rope_scaling` in hf_config().
_ROPE_FREQS = "rope_freqs.weight"


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One tensor of the file, ready to be read on demand."""

    gguf_name: str
    index: int  # position in GGUFReader.tensors
    qtype: GGMLType
    shape: tuple[int, ...]  # numpy order = HF order
    unpermute_heads: int | None  # undo llama.cpp's Q/K row permutation with this many heads
    norm_offset: float


def _field_value(field: Any) -> Any:
    """A ReaderField as a plain Python value; strings that are not UTF-8 keep their bytes as
    surrogate escapes (`s.encode("utf-8", "surrogateescape")` recovers them)."""
    kind = field.types[0] if field.types else None
    if kind == gguf.GGUFValueType.STRING:
        return bytes(field.parts[-1]).decode("utf-8", "surrogateescape")
    if kind == gguf.GGUFValueType.ARRAY:
        if len(field.types) == 1:
            return []
        if len(field.types) > 2:  # arrays of arrays: gguf-py flattens them
            return field.contents()
        if field.types[1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", "surrogateescape") for i in field.data]
        return np.concatenate([field.parts[i] for i in field.data]).tolist()
    value = field.parts[-1][0]
    if kind == gguf.GGUFValueType.FLOAT32:
        # The shortest decimal that round-trips through float32: 1e-05, not 9.999999747378752e-06.
        return float(str(np.float32(value)))
    return value.item()


def _undo_rotary_permutation(
    w: np.ndarray, n_heads: int, what: str
) -> np.ndarray:  # f32[rows, ...]
    """Inverse of llama.cpp's Q/K permutation for `llama` checkpoints.

    HF rotates the two halves of each head (`rotate_half`); llama.cpp rotates adjacent pairs, so its
    converter reorders each head's rows from `[2, head_dim/2]` to `[head_dim/2, 2]`. Reading each
    head's rows as `[head_dim/2, 2]` and transposing puts them back.
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise GGUFError(f"{what}: {rows} rows do not split into {n_heads} heads of even size")
    pairs = w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
    return pairs.swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_factors(
    factor: float, low: float, high: float, original_ctx: int, theta: float, dim: int
) -> np.ndarray:
    """f64[dim/2]: the frequency divisors that Llama 3 rope scaling applies per rotary pair."""
    wavelen = 2 * math.pi * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    smooth = (original_ctx / wavelen - low) / (high - low)
    blended = 1.0 / ((1.0 - smooth) / factor + smooth)
    out = np.where(wavelen < original_ctx / high, 1.0, blended)
    return np.where(wavelen > original_ctx / low, factor, out)


@dataclasses.dataclass
class GGUFCheckpoint:
    """An opened GGUF file: metadata in memory, tensors read one at a time from a memory map."""

    path: str
    metadata: dict[str, Any]
    _reader: gguf.GGUFReader = dataclasses.field(repr=False, compare=False)
    _entries: dict[str, _Entry] = dataclasses.field(repr=False, compare=False)

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]

    def tensor_names(self) -> list[str]:
        """HF names of every tensor, in file order."""
        return list(self._entries)

    def tensor(self, hf_name: str) -> np.ndarray:
        """One tensor, dequantized to float32 in HF layout (a new array, not a view of the file)."""
        entry = self._entries.get(hf_name)
        if entry is None:
            raise GGUFError(f"{self.path}: no tensor named {hf_name!r}")
        what = f"{self.path}: tensor {entry.gguf_name!r} ({entry.qtype.name}, shape {entry.shape})"
        try:
            w = dequantize(self._reader.tensors[entry.index].data, entry.qtype, entry.shape)
        except GGUFError as e:
            raise GGUFError(f"{what}: {e}") from None
        if entry.unpermute_heads is not None:
            w = _undo_rotary_permutation(w, entry.unpermute_heads, what)
        if entry.norm_offset:
            w -= np.float32(entry.norm_offset)
        return w

    def native_int4_groups(self) -> int | None:
        """`NATIVE4_GROUP` (32) when a 2-D tensor other than the (int8) embedding and LM head is
        Q4_0 / Q4_1 / Q4_K (int4 groups of 32 hold them: exactly, Q4_K to one f16 rounding), else
        None. The file's other block tensors (a Q4_K_M file's Q6_K ones) then requantize to 4
        bits in those groups (`requantize4`; `int4_requantized` names them)."""
        kinds = {e.qtype for e in self._block_entries(vocab=False).values()}
        return NATIVE4_GROUP if kinds & set(_NATIVE4) else None

    def native_int8_groups(self) -> int | None:
        """The int8 group size holding every 2-D block-quantized tensor exactly, when all are
        symmetric types (`SYMMETRIC_BLOCK`: Q8_0 / Q4_0 / Q5_0 32, Q6_K 16; the smallest), else
        None (a type with mins, Q4_1 / Q4_K / Q5_1 / Q5_K, requantizes in any group)."""
        kinds = {e.qtype for e in self._block_entries(vocab=True).values()}
        if not kinds or not kinds <= set(SYMMETRIC_BLOCK):
            return None
        return min(SYMMETRIC_BLOCK[k] for k in kinds)

    def has_blocks(self) -> bool:
        """Whether any 2-D tensor is block-quantized (not stored as floats)."""
        return bool(self._block_entries(vocab=True))

    def native_int4_share(self) -> float:
        """The share of the block-quantized values outside the embedding and LM head that are
        Q4_0 / Q4_1 / Q4_K (0 without any): whether the file is a 4-bit one (a Q4_K_M file's
        Q6_K tensors are a minority) or an 8-bit one with a few 4-bit tensors."""
        entries = self._block_entries(vocab=False).values()
        total = sum(math.prod(e.shape) for e in entries)
        four = sum(math.prod(e.shape) for e in entries if e.qtype in _NATIVE4)
        return four / total if total else 0.0

    def int4_requantized(self) -> list[str]:
        """HF names of the linear tensors an int4 load requantizes (not a native 4-bit type)."""
        return [n for n, e in self._block_entries(vocab=False).items() if e.qtype not in _NATIVE4]

    def _block_entries(self, vocab: bool) -> dict[str, _Entry]:
        """The 2-D block-quantized tensors; without `vocab`, not the embedding and LM head (int8
        under int4)."""
        skip = re.compile(r".*(embed_tokens|lm_head)")
        return {
            n: e
            for n, e in self._entries.items()
            if (vocab or not skip.match(n)) and len(e.shape) == 2 and e.qtype not in _FLOAT_TYPES
        }

    def quantized(self, hf_name: str, fmt: str, groups: int = 1) -> tuple[np.ndarray, ...] | None:
        """A 2-D block-quantized tensor requantized to `fmt` ("int8" | "fp8") with `groups` scales
        per row (HF layout: data [out, in], scale f32[out, groups] along `in`), a chunk of rows at
        a time, never whole in float32. Groups of symmetric blocks (Q8_0, Q4_0, Q5_0) fold their
        block scales exactly into int8 where they can (`checkpoints.quantize.fold_block_scales`).
        None for tensors stored as floats and for 1-D ones: read those with `tensor`.
        """
        entry = self._entries.get(hf_name)
        if entry is None:
            raise GGUFError(f"{self.path}: no tensor named {hf_name!r}")
        if entry.qtype in _FLOAT_TYPES or len(entry.shape) != 2 or entry.norm_offset:
            return None
        what = f"{self.path}: tensor {entry.gguf_name!r} ({entry.qtype.name}, shape {entry.shape})"
        rows, cols = entry.shape
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[entry.qtype]
        raw = (
            np.ascontiguousarray(self._reader.tensors[entry.index].data).reshape(-1).view(np.uint8)
        )
        if raw.size != rows * cols // block_size * block_bytes:
            raise GGUFError(
                f"{what}: holds {raw.size} bytes, expected {rows * cols // block_size * block_bytes}"
            )
        if cols % groups:
            raise GGUFError(f"{what}: {groups} scale groups do not divide its {cols} columns")
        by_row = raw.reshape(rows, cols // block_size * block_bytes)
        if fmt.startswith("int4"):
            out = requantize4(by_row, entry.qtype, cols, groups, fmt.endswith("-sym"))
        else:
            out = requantize(by_row, entry.qtype, cols, fmt, groups)
        if entry.unpermute_heads is not None:
            out = tuple(_undo_rotary_permutation(x, entry.unpermute_heads, what) for x in out)
        return out

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """(HF name, float32 array) for every tensor, reading one at a time."""
        for name in self._entries:
            yield name, self.tensor(name)

    def _key(self, suffix: str, default: Any = ...) -> Any:
        key = f"{self.architecture}.{suffix}"
        if key in self.metadata:
            return self.metadata[key]
        if default is ...:
            raise GGUFError(f"{self.path}: missing metadata key {key!r}")
        return default

    def _uniform_key(self, suffix: str, default: Any = ...) -> Any:
        """A per-model number that some files store per layer: every layer must agree."""
        value = self._key(suffix, default)
        if isinstance(value, list):
            if not value or any(v != value[0] for v in value):
                key = f"{self.architecture}.{suffix}"
                raise GGUFError(f"{self.path}: per-layer {key!r} = {value} is not supported")
            value = value[0]
        return value

    def hf_config(self) -> dict[str, Any]:
        """A HF `config.json`-style dict for this checkpoint."""
        arch = self.architecture
        rules = _ARCHS[arch]
        hidden = self._key("embedding_length")
        n_heads = self._uniform_key("attention.head_count")
        n_kv_heads = self._uniform_key("attention.head_count_kv", n_heads)
        rope_dim = self._key("rope.dimension_count", None)
        head_dim = self._key("attention.key_length", rope_dim or hidden // n_heads)
        value_dim = self._key("attention.value_length", head_dim)
        if value_dim != head_dim:
            raise GGUFError(f"{self.path}: value head size {value_dim} != key head size {head_dim}")
        if rope_dim is not None and rope_dim != head_dim:
            raise GGUFError(
                f"{self.path}: partial rotary ({arch}.rope.dimension_count={rope_dim} with "
                f"head_dim={head_dim}) is not supported"
            )
        cfg: dict[str, Any] = {
            "architectures": [rules.hf_class],
            "model_type": arch,
            "hidden_size": hidden,
            "intermediate_size": self._uniform_key("feed_forward_length"),
            "num_hidden_layers": self._key("block_count"),
            "num_attention_heads": n_heads,
            "num_key_value_heads": n_kv_heads,
            "head_dim": head_dim,
            "rms_norm_eps": self._key("attention.layer_norm_rms_epsilon"),
            "rope_theta": self._key("rope.freq_base", 10000.0),
            "max_position_embeddings": self._key("context_length"),
            "vocab_size": self._vocab_size(),
            "tie_word_embeddings": "lm_head.weight" not in self._entries,
            "hidden_act": rules.hidden_act,
            "attention_bias": any(
                e.gguf_name.endswith((".attn_q.bias", ".attn_k.bias", ".attn_v.bias"))
                for e in self._entries.values()
            ),
        }
        if arch == "llama":
            cfg["mlp_bias"] = any(
                e.gguf_name.startswith("blk.")
                and ".ffn_" in e.gguf_name
                and e.gguf_name.endswith(".bias")
                for e in self._entries.values()
            )
        if arch.startswith("gemma"):
            cfg["hidden_activation"] = rules.hidden_act
        for hf_key, gguf_key in (
            ("bos_token_id", "tokenizer.ggml.bos_token_id"),
            ("eos_token_id", "tokenizer.ggml.eos_token_id"),
            ("pad_token_id", "tokenizer.ggml.padding_token_id"),
        ):
            if gguf_key in self.metadata:
                cfg[hf_key] = self.metadata[gguf_key]
        sliding_window = self._key("attention.sliding_window", None)
        if sliding_window is not None:
            cfg["sliding_window"] = sliding_window
        if arch == "gemma2":
            for name in ("attn_logit_softcapping", "final_logit_softcapping"):
                cfg[name] = self._key(name, None)
            # NOTE: GGUF has no key for Gemma 2's query scale. llama.cpp uses hidden/heads for the
            # 46-layer (27B) model and head_dim otherwise, matching the HF configs; so do we.
            layers = cfg["num_hidden_layers"]
            cfg["query_pre_attn_scalar"] = hidden // n_heads if layers == 46 else head_dim
        cfg["rope_scaling"] = self._rope_scaling(head_dim, cfg["rope_theta"])
        return cfg

    def _vocab_size(self) -> int:
        rows = self._entries["model.embed_tokens.weight"].shape[0]
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        declared = self._key("vocab_size", len(tokens) if tokens is not None else rows)
        if declared != rows:
            raise GGUFError(
                f"{self.path}: vocabulary of {declared} tokens but token_embd.weight has {rows} rows"
            )
        return rows

    def _rope_scaling(self, head_dim: int, theta: float) -> dict[str, Any] | None:
        prefix = f"{self.architecture}.rope.scaling."
        keys = {k[len(prefix) :]: v for k, v in self.metadata.items() if k.startswith(prefix)}
        kind = keys.pop("type", "none")
        keys.pop("finetuned", None)
        if self._has_rope_freqs:
            if kind != "none" or keys:
                raise GGUFError(f"{self.path}: both {_ROPE_FREQS} and rope.scaling.* keys present")
            return self._llama3_rope_scaling(head_dim, theta)
        if kind == "none":
            if keys:
                raise GGUFError(f"{self.path}: rope scaling keys {sorted(keys)} without a type")
            return None
        if kind not in ("linear", "yarn"):
            raise GGUFError(f"{self.path}: unsupported rope scaling type {kind!r}")
        out: dict[str, Any] = {"rope_type": kind}
        renames = {
            "factor": "factor",
            "original_context_length": "original_max_position_embeddings",
            "yarn_beta_fast": "beta_fast",
            "yarn_beta_slow": "beta_slow",
        }
        for key, value in keys.items():
            if key not in renames:
                raise GGUFError(f"{self.path}: unsupported rope scaling key {prefix + key!r}")
            out[renames[key]] = value
        if "factor" not in out:
            raise GGUFError(f"{self.path}: rope scaling {kind!r} without {prefix}factor")
        return out

    @property
    def _has_rope_freqs(self) -> bool:
        return any(t.name == _ROPE_FREQS for t in self._reader.tensors)

    def _llama3_rope_scaling(self, head_dim: int, theta: float) -> dict[str, Any]:
        """Recover Llama 3 `rope_scaling` from llama.cpp's `rope_freqs.weight` divisors.

        The divisors do not pin the parameters down uniquely, so we take the largest divisor as the
        factor, assume the values every Llama 3.x release uses for the rest, and check that these
        reproduce the stored divisors.
        """
        tensor = next(t for t in self._reader.tensors if t.name == _ROPE_FREQS)
        shape = tuple(int(x) for x in reversed(tensor.shape.tolist()))
        stored = dequantize(tensor.data, tensor.tensor_type, shape).reshape(-1)
        if stored.size != head_dim // 2:
            raise GGUFError(
                f"{self.path}: {_ROPE_FREQS} has {stored.size} values, not {head_dim // 2}"
            )
        params = {
            "rope_type": "llama3",
            "factor": float(str(stored.max())),
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        expected = _llama3_rope_factors(params["factor"], 1.0, 4.0, 8192, theta=theta, dim=head_dim)
        if not np.allclose(stored, expected, rtol=1e-5, atol=0):
            raise GGUFError(
                f"{self.path}: {_ROPE_FREQS} does not match Llama 3 rope scaling with "
                f"factor={params['factor']}, low/high_freq_factor=1/4, original context 8192"
            )
        return params


def _map_tensor_name(gguf_name: str, arch: str) -> str | None:
    """The HF name of a GGUF tensor, or None when the architecture has no such tensor."""
    layer_names, global_names = _names(arch)
    if m := _LAYER_TENSOR.fullmatch(gguf_name):
        layer, part, kind = m.groups()
        hf_part = layer_names.get(part)
        if hf_part is None or (kind == "bias" and part not in _ARCHS[arch].biases):
            return None
        return f"model.layers.{int(layer)}.{hf_part}.{kind}"
    if m := _GLOBAL_TENSOR.fullmatch(gguf_name):
        part, kind = m.groups()
        if part in global_names and kind == "weight":
            return f"{global_names[part]}.{kind}"
    return None


def read_gguf(path: str | os.PathLike) -> GGUFCheckpoint:
    """Open a GGUF checkpoint; tensors stay in the file until asked for.

    Args:
        path: the `.gguf` file.

    Returns:
        A GGUFCheckpoint with the metadata read and every tensor name mapped to HF's.

    Raises:
        GGUFError: missing or unreadable file, bad magic, truncation, unsupported architecture,
            unknown tensor name or unsupported quantization type.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise GGUFError(
            f"{path}: no such file" if not os.path.exists(path) else f"{path}: not a file"
        )
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != _GGUF_MAGIC:
        raise GGUFError(
            f"{path}: not a GGUF file (starts with {magic!r}, expected {_GGUF_MAGIC!r})"
        )
    try:
        reader = BoundedReader(path)
    except Problem as e:
        raise GGUFError(f"{path}: {e}") from None
    except Exception as e:  # gguf-py raises ValueError, KeyError, IndexError, ... on bad files
        raise GGUFError(f"{path}: unreadable GGUF file ({type(e).__name__}: {e})") from e
    if reader.byte_order != "I":
        raise GGUFError(f"{path}: big-endian GGUF files are not supported")

    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # the reader's pseudo-fields: version and counts
            continue
        try:
            metadata[key] = _field_value(field)
        except Exception as e:
            raise GGUFError(f"{path}: metadata key {key!r} is unreadable ({e})") from e

    arch = metadata.get("general.architecture")
    experts = metadata.get(f"{arch}.expert_count")
    if experts or (isinstance(arch, str) and arch.endswith("moe")):
        raise GGUFError(
            f"{path}: mixture-of-experts GGUF checkpoints are not supported (architecture {arch!r}, "
            f"{arch}.expert_count={experts}); load the model's HF safetensors directory instead"
        )
    if arch not in _ARCHS:
        raise GGUFError(
            f"{path}: unsupported architecture {arch!r} (supported: {', '.join(sorted(_ARCHS))})"
        )
    rules = _ARCHS[arch]
    n_layers = metadata.get(f"{arch}.block_count")
    n_heads = metadata.get(f"{arch}.attention.head_count")
    n_kv_heads = metadata.get(f"{arch}.attention.head_count_kv", n_heads)
    if rules.permute_qk and not (isinstance(n_heads, int) and isinstance(n_kv_heads, int)):
        raise GGUFError(
            f"{path}: {arch}.attention.head_count / head_count_kv must be single integers to "
            f"undo the Q/K permutation (got {n_heads!r} / {n_kv_heads!r})"
        )

    entries: dict[str, _Entry] = {}
    for index, t in enumerate(reader.tensors):
        if t.name == _ROPE_FREQS and arch == "llama":
            continue
        hf_name = _map_tensor_name(t.name, arch)
        if hf_name is None:
            raise GGUFError(f"{path}: unknown tensor {t.name!r} for architecture {arch!r}")
        if t.tensor_type not in SUPPORTED_TYPES:
            raise GGUFError(
                f"{path}: tensor {t.name!r} has unsupported type {t.tensor_type.name} "
                f"(supported: {', '.join(sorted(x.name for x in SUPPORTED_TYPES))})"
            )
        if hf_name.startswith("model.layers.") and isinstance(n_layers, int):
            layer = int(hf_name.split(".")[2])
            if layer >= n_layers:
                raise GGUFError(f"{path}: tensor {t.name!r} is past {arch}.block_count={n_layers}")
        part = t.name.split(".")[-2]
        unpermute = None
        if rules.permute_qk and part in ("attn_q", "attn_k"):
            unpermute = n_heads if part == "attn_q" else n_kv_heads
        is_norm = t.name.endswith("norm.weight")
        entries[hf_name] = _Entry(
            gguf_name=t.name,
            index=index,
            qtype=t.tensor_type,
            shape=tuple(int(x) for x in reversed(t.shape.tolist())),
            unpermute_heads=unpermute,
            norm_offset=rules.norm_offset if is_norm else 0.0,
        )
    if "model.embed_tokens.weight" not in entries:
        raise GGUFError(f"{path}: no token_embd.weight tensor")
    return GGUFCheckpoint(path=path, metadata=metadata, _reader=reader, _entries=entries)
