"""Checkpoint conversion (HF dir / GGUF -> orbax dir) and how loading fails on bad inputs.

1. A tiny random Llama saved by `transformers` (one file, and sharded with an index) plus a tiny
   WordLevel `tokenizer.json` is converted by `scripts/convert.py` and by `convert()`; restoring
   the orbax dir gives exactly the torch weights, leaf by leaf, and the same tokenizer.
2. `convert()` guards its destination: a non-empty dir needs `force`, the source is never its
   own destination, and an interrupted conversion is reported as such by the loader.
3. The embedded SmolLM2 GGUF converted to orbax generates the same greedy tokens as the GGUF.
4. Bad inputs to `load_model` / `LLM` raise errors naming the path, file or value at fault.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

from checkpoints.errors import CheckpointError, GGUFError
from checkpoints.orbax_layout import PARAMS_DIR
from jaxinfer.config import ModelConfig, UnsupportedConfigError
from jaxinfer.convert import OUTPUT_NAMES, convert
from jaxinfer.loader import load_model
from jaxinfer.model_info import GGUF_TOKENIZER_FILE
from jaxinfer.sampling_params import SamplingParams
from tests.model_utils import hf_config_dict, make_hf_model, params_from_torch

REPO_ROOT = Path(__file__).resolve().parents[1]
WORDS = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(253)]  # 256 = the tiny vocab
TINY_ENGINE = dict(max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16)


def _assert_params_equal(got: Any, want: Any) -> None:
    got_leaves, got_def = jax.tree_util.tree_flatten_with_path(got)
    want_leaves, want_def = jax.tree_util.tree_flatten_with_path(want)
    assert got_def == want_def
    for (path, a), (_, b) in zip(got_leaves, want_leaves, strict=True):
        assert a.dtype == b.dtype, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(
            np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path)
        )


def _write_tokenizer(root: Path) -> None:
    tok = tokenizers.Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>")
    )
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (root / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny model saved as one safetensors file and as 5 shards, and its torch weights."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    model, _ = make_hf_model("llama")
    single = tmp_path_factory.mktemp("hf_single")
    sharded = tmp_path_factory.mktemp("hf_sharded")
    model.save_pretrained(str(single), safe_serialization=True)
    model.save_pretrained(str(sharded), safe_serialization=True, max_shard_size="100KB")
    for root in (single, sharded):
        _write_tokenizer(root)
    cfg = ModelConfig.from_hf(hf_config_dict("llama"))
    return {"single": single, "sharded": sharded, "params": params_from_torch(model, cfg)}


@pytest.fixture(scope="module")
def tiny_orbax(tiny: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The single-file tiny model converted by the script, run as a user would run it."""
    dst = tmp_path_factory.mktemp("converted") / "tiny"
    proc = subprocess.run(
        [sys.executable, "scripts/convert.py", str(tiny["single"]), str(dst)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {dst}" in proc.stdout
    return dst


def test_hf_to_orbax_restores_identical_params(tiny: dict[str, Any], tiny_orbax: Path) -> None:
    files = {p.name for p in tiny_orbax.iterdir()}
    assert files == {
        PARAMS_DIR,
        "config.json",
        "jaxinfer.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "chat_template.jinja",
    }
    info = json.loads((tiny_orbax / "jaxinfer.json").read_text())
    assert info == {
        "source": str(tiny["single"]),
        "source_kind": "hf",
        "dtype": "float32",
        "quantization": None,
    }
    source_config = json.loads((tiny["single"] / "config.json").read_text())
    assert json.loads((tiny_orbax / "config.json").read_text()) == source_config

    restored = load_model(tiny_orbax, dtype="float32")
    assert restored.source == "orbax" and restored.hf_config == source_config
    _assert_params_equal(restored.params, tiny["params"])
    from_hf = load_model(tiny["single"], dtype="float32")
    assert restored.cfg == from_hf.cfg
    text = "w3 w7 w250 unknown w9"
    assert restored.tokenizer.encode(text) == from_hf.tokenizer.encode(text) == [6, 10, 253, 0, 12]
    assert restored.tokenizer.eos_token_ids == from_hf.tokenizer.eos_token_ids == (2,)
    assert restored.tokenizer.apply_chat_template([{"role": "user", "content": "w1"}]) == "w1 "


def test_sharded_hf_checkpoint_converts_identically(tiny: dict[str, Any], tmp_path: Path) -> None:
    shards = sorted(p.name for p in tiny["sharded"].glob("*.safetensors"))
    assert len(shards) > 1 and (tiny["sharded"] / "model.safetensors.index.json").is_file()
    _assert_params_equal(load_model(tiny["sharded"], dtype="float32").params, tiny["params"])
    dst = convert(tiny["sharded"], tmp_path / "sharded")
    _assert_params_equal(load_model(dst, dtype="float32").params, tiny["params"])


def test_quantized_conversion_loads_back_quantized(
    tiny: dict[str, Any], tiny_orbax: Path, tmp_path: Path
) -> None:
    """An int8 conversion restores as int8 without asking; a float one quantizes at load to the
    same bits as the HF source loaded with quantization="int8"; formats cannot be switched."""
    dst = Path(convert(tiny["single"], tmp_path / "int8", quantization="int8"))
    assert json.loads((dst / "jaxinfer.json").read_text())["quantization"] == "int8"
    from_hf = load_model(tiny["single"], dtype="float32", quantization="int8")
    restored = load_model(dst, dtype="float32")
    assert restored.quantization == from_hf.quantization == "int8"
    _assert_params_equal(restored.params, from_hf.params)
    _assert_params_equal(
        load_model(tiny_orbax, dtype="float32", quantization="int8").params, from_hf.params
    )
    with pytest.raises(CheckpointError, match="quantization='int8'.*quantization='fp8'"):
        load_model(dst, quantization="fp8")
    # An int8 checkpoint of the per-channel layout before group-wise scales (scale [N], not
    # [G, N]) is refused naming the leaf and what to do.
    from checkpoints.orbax_io import save_params
    from jaxinfer.quantization import QArray

    old = jax.tree.map(
        lambda q: QArray(q.data, q.scale.reshape(-1)) if isinstance(q, QArray) else q,
        restored.params,
        is_leaf=lambda x: isinstance(x, QArray),
    )
    shutil.rmtree(dst / PARAMS_DIR)
    save_params(dst, old)
    with pytest.raises(
        CheckpointError, match=r"\.scale: checkpoint shape .*convert its float source again"
    ):
        load_model(dst, dtype="float32")


def test_grouped_and_packed_conversions_load_back_in_their_format(
    tiny: dict[str, Any], tmp_path: Path
) -> None:
    """The saved format keeps its group size and act-order (read back from the saved shapes and
    leaves): an "int8-g32" conversion, and an 8-bit act-order GPTQ checkpoint ("int8-g32-act"),
    restore as they loaded from their sources, bit for bit; a 4-bit GPTQ one, which loads as
    int4, is refused naming why (orbax stores no 4-bit type)."""
    from safetensors.numpy import load_file

    from tests.packed_checkpoints import write_packed

    dst = Path(convert(tiny["single"], tmp_path / "g32", quantization="int8-g32"))
    restored = load_model(dst, dtype="float32")
    from_hf = load_model(tiny["single"], dtype="float32", quantization="int8-g32")
    assert restored.quantization == from_hf.quantization == "int8-g32"
    _assert_params_equal(restored.params, from_hf.params)

    sd = load_file(str(tiny["single"] / "model.safetensors"))
    config = json.loads((tiny["single"] / "config.json").read_text())
    for bits in (8, 4):
        src = tmp_path / f"gptq{bits}"
        shutil.copytree(tiny["single"], src)
        write_packed(src, config, sd, "gptq", bits, act_order=True)
        if bits == 4:
            with pytest.raises(ValueError, match="loads as int4-g32-act.*no 4-bit type"):
                convert(src, tmp_path / "gptq4.orbax")
            continue
        dst = Path(convert(src, tmp_path / "gptq8.orbax"))
        assert json.loads((dst / "jaxinfer.json").read_text())["quantization"] == "int8-g32-act"
        restored, source = load_model(dst, dtype="float32"), load_model(src, dtype="float32")
        assert restored.quantization == source.quantization == "int8-g32-act"
        _assert_params_equal(restored.params, source.params)


def test_bfloat16_conversion_is_cast_once(tiny: dict[str, Any], tmp_path: Path) -> None:
    dst = Path(convert(tiny["single"], tmp_path / "bf16", dtype="bfloat16"))
    assert json.loads((dst / "jaxinfer.json").read_text())["dtype"] == "bfloat16"
    as_bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), tiny["params"])
    _assert_params_equal(load_model(dst, dtype="bfloat16").params, as_bf16)
    as_f32 = jax.tree.map(lambda x: x.astype(jnp.float32), as_bf16)
    _assert_params_equal(load_model(dst, dtype="float32").params, as_f32)


def test_destination_guards(tiny: dict[str, Any], tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "notes.txt").write_text("keep me")
    (dst / GGUF_TOKENIZER_FILE).write_text("{}")  # stale: would shadow the HF tokenizer
    with pytest.raises(FileExistsError, match=f"{dst}.*not empty.*--force"):
        convert(tiny["single"], dst)
    convert(tiny["single"], dst, force=True)
    assert (dst / "notes.txt").read_text() == "keep me"
    assert not (dst / GGUF_TOKENIZER_FILE).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]  # no temporary dir left behind
    _assert_params_equal(load_model(dst, dtype="float32").params, tiny["params"])

    with pytest.raises(FileExistsError, match="is the source itself"):
        convert(tiny["single"], tiny["single"], force=True)
    with pytest.raises(CheckpointError, match="already a jaxinfer orbax checkpoint"):
        convert(dst, tmp_path / "again")
    with pytest.raises(ValueError, match="float16"):
        convert(tiny["single"], tmp_path / "f16", dtype="float16")
    assert set(OUTPUT_NAMES) >= {p.name for p in dst.iterdir()} - {"notes.txt"}
    empty = tmp_path / "empty"
    empty.mkdir()
    convert(tiny["single"], empty)
    assert (empty / "jaxinfer.json").is_file()


def test_interrupted_conversion_is_named(tiny_orbax: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_orbax, broken)
    (broken / PARAMS_DIR / "_CHECKPOINT_METADATA").unlink()
    with pytest.raises(CheckpointError, match=f"{broken / PARAMS_DIR}.*interrupted"):
        load_model(broken)


def test_checkpoint_of_unfused_qkv_is_refused_by_name(monkeypatch, tmp_path: Path) -> None:
    """A checkpoint converted before the fused QKV weight (its leaves `attn.q`, `attn.kv`) is
    refused with what to do, before anything is restored (read from its metadata alone)."""
    from checkpoints import orbax_io
    from jaxinfer import loader

    old = {
        "layers.0.attn.q": ((64, 64), np.dtype("float32")),
        "layers.0.attn.kv": ((64, 2, 32), np.dtype("float32")),
        "layers.0.attn.o": ((64, 64), np.dtype("float32")),
    }
    monkeypatch.setattr(orbax_io, "saved_leaves", lambda path: old)
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.kv.*convert its source again"):
        loader.orbax_quantization(str(tmp_path))
    new = {"layers.0.attn.qkv": ((64, 2, 4, 16), np.dtype("float32")), **old}
    del new["layers.0.attn.kv"]
    monkeypatch.setattr(orbax_io, "saved_leaves", lambda path: new)  # DeepSeek's attn.q stays
    assert loader.orbax_quantization(str(tmp_path)) is None


@pytest.mark.slow
def test_gguf_to_orbax_generates_the_same_tokens(tmp_path: Path) -> None:
    from jaxinfer.default_model import default_model_path
    from jaxinfer.llm import LLM

    try:
        gguf_path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    dst = Path(convert(gguf_path, tmp_path / "smollm2"))
    assert json.loads((dst / "jaxinfer.json").read_text())["source_kind"] == "gguf"
    tok_meta = json.loads((dst / GGUF_TOKENIZER_FILE).read_text())
    assert tok_meta["general.architecture"] == "llama"
    assert len(tok_meta["tokenizer.ggml.tokens"]) == 49152

    # NOTE: the prompt prefills in one 8-token step and decodes pad to 8: one program, the same
    # one (cache shape, sequences, bucket) as test_spec_decode's and test_served_default's
    # default-model engines, so in the suite it is a compilation-cache read
    options = dict(
        max_model_len=256,
        max_num_seqs=2,
        num_pages=40,
        max_num_batched_tokens=8,
        token_buckets=(8,),
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = "The capital of France is"
    # the GGUF file's blocks as floats, as the conversion stores them
    want = LLM(None, quantization="none", **options).generate(prompt, greedy)[0]
    got = LLM(dst, **options).generate(prompt, greedy)[0]
    assert got.prompt_token_ids == want.prompt_token_ids
    assert len(got.token_ids) == 8
    assert got.token_ids == want.token_ids and got.text == want.text


def test_missing_path_is_named(tmp_path: Path) -> None:
    from jaxinfer.llm import LLM

    missing = tmp_path / "no_such_model"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_model(missing)
    with pytest.raises(FileNotFoundError, match=str(missing)):
        LLM(missing)


def test_unknown_architecture_is_named(tiny: dict[str, Any], tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                **hf_config_dict("llama"),
                "model_type": "gpt_neox",
                "architectures": ["GPTNeoXForCausalLM"],
            }
        )
    )
    # The config is judged before the weights: with no weights at all it is still the named error.
    with pytest.raises(UnsupportedConfigError, match="model_type='gpt_neox'"):
        load_model(tmp_path)
    shutil.copy(tiny["single"] / "model.safetensors", tmp_path)
    with pytest.raises(UnsupportedConfigError, match="model_type='gpt_neox'"):
        load_model(tmp_path)


def test_corrupted_safetensors_header_names_the_file(tiny: dict[str, Any], tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny["single"], broken)
    weights = broken / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:16] = b"\xff\xfe garb"
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{weights}.*corrupted header"):
        load_model(broken)


def test_dir_without_weights_is_named(tiny: dict[str, Any], tmp_path: Path) -> None:
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(tiny["single"] / name, tmp_path)
    with pytest.raises(CheckpointError, match=f"no safetensors weights in {tmp_path}"):
        load_model(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(CheckpointError, match=f"{tmp_path}.*holds no model"):
        load_model(tmp_path)


def test_missing_tensor_names_the_checkpoint(tiny: dict[str, Any], tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny["single"], broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"{broken}.*missing tensors.*model.norm.weight"):
        load_model(broken)


def test_truncated_gguf_is_named(tmp_path: Path) -> None:
    from jaxinfer.default_model import default_model_path

    try:
        gguf_path = Path(default_model_path())
    except FileNotFoundError as e:
        pytest.skip(str(e))
    truncated = tmp_path / "truncated.gguf"
    with gguf_path.open("rb") as f:
        truncated.write_bytes(f.read(4 << 20))  # the metadata and the first tensors' data
    with pytest.raises(GGUFError, match=f"{truncated}.*truncated"):
        load_model(truncated)
    truncated.write_bytes(truncated.read_bytes()[:1000])  # cut inside the metadata
    with pytest.raises(GGUFError, match=str(truncated)):
        load_model(truncated)


@pytest.fixture(scope="module")
def tiny_llm(tiny: dict[str, Any]) -> Any:
    from jaxinfer.llm import LLM

    return LLM(tiny["single"], dtype="float32", **TINY_ENGINE)


def test_prompt_longer_than_max_model_len(tiny_llm: Any) -> None:
    with pytest.raises(ValueError, match=r"prompt of 40 tokens .* max_model_len=32"):
        tiny_llm.generate([list(range(3, 43))])
    long_text = " ".join(f"w{i}" for i in range(33))
    with pytest.raises(ValueError, match=r"prompt of 33 tokens .* max_model_len=32"):
        tiny_llm.generate(long_text, SamplingParams(max_tokens=1))


def test_empty_prompt(tiny_llm: Any) -> None:
    with pytest.raises(ValueError, match="prompt is empty"):
        tiny_llm.generate("")
    with pytest.raises(ValueError, match="prompt is empty"):
        tiny_llm.generate([[]])
    assert not tiny_llm.engine.has_unfinished()
