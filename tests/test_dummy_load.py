"""`load_format="dummy"`: random weights from a model's config, made on the devices.

1. Against a real load of the same config (a tiny HF checkpoint written by `transformers`): the
   same tree, and every leaf with the same shape, dtype and sharding, on one device and on a
   `data=2,tensor=4` and a `pipeline=2,tensor=4` mesh of 8 virtual CPU devices; the dummy load reads a
   directory that holds only `config.json` and the tokenizer.
2. The values: finite, random (not a constant), norms at their neutral init, bf16 when asked.
3. `LLM(path, load_format="dummy")` generates tokens with finite logprobs from a directory that
   holds only `config.json` (the placeholder vocabulary renders ids as `<id>`); `serve.py
   --load-format dummy` builds its engine from a config + tokenizer directory.
4. A bad `load_format` raises naming it (`LLM`, `load_model`, the scripts' flags); a directory
   without `config.json` raises naming the path.
5. Leaves drawn by their own programs (the large ones) keep the one program's values bit for bit.
"""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.errors import CheckpointError
from jaxinfer import sharding as shd
from jaxinfer.loader import load_model
from jaxinfer.model_info import LOAD_FORMATS
from tests.script_utils import script


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(HF dir with weights, dir with only config.json and the tokenizer, dir with config.json)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    root = tmp_path_factory.mktemp("hf")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(str(root), safe_serialization=True)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(128)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text('{"eos_token": "t2"}')
    bare = tmp_path_factory.mktemp("config_only")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(root / name, bare / name)
    config_only = tmp_path_factory.mktemp("config_json_only")
    shutil.copy(root / "config.json", config_only / "config.json")
    return str(root), str(bare), str(config_only)


def _leaves(params):
    return jax.tree_util.tree_flatten_with_path(params)[0]


@pytest.mark.parametrize("mesh", ["", "data=2,tensor=4", "pipeline=2,tensor=4"])
def test_dummy_matches_a_real_load(checkpoint, mesh):
    if mesh and jax.device_count() != 8:
        pytest.skip("needs 8 devices (tests/conftest.py sets 8 virtual CPU devices)")
    real_dir, bare_dir, _ = checkpoint
    mesh_obj = shd.make_mesh(mesh or None)
    real = load_model(real_dir, dtype="float32", mesh=mesh_obj)
    dummy = load_model(bare_dir, dtype="float32", mesh=mesh_obj, load_format="dummy")
    assert dummy.source == "dummy" and dummy.cfg == real.cfg and dummy.dtype == "float32"
    assert dummy.tokenizer.encode("t5 t9") == real.tokenizer.encode("t5 t9") == [5, 9]
    got, want = _leaves(dummy.params), _leaves(real.params)
    assert [p for p, _ in got] == [p for p, _ in want]
    for (path, x), (_, y) in zip(got, want):
        name = jax.tree_util.keystr(path)
        assert (x.shape, x.dtype) == (y.shape, y.dtype), name
        assert x.sharding.is_equivalent_to(y.sharding, x.ndim), name
        v = np.asarray(x)
        assert np.isfinite(v).all(), name
        if "norm" in name:
            assert (v == 1).all(), name
        else:
            assert 0.01 < v.std() < 0.03, name  # the declared std 0.02


def test_dummy_bf16_generates_with_finite_logprobs(checkpoint):
    from jaxinfer import LLM, SamplingParams

    llm = LLM(
        checkpoint[2],
        dtype="bfloat16",
        load_format="dummy",
        page_size=4,
        num_pages=16,
        max_model_len=32,
        max_num_seqs=2,
        max_num_batched_tokens=8,
    )
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(llm.model.params))
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    out = llm.generate([[5, 6, 7], [9, 10]], sp)
    assert llm.tokenizer.vocab_size == 128 and llm.tokenizer.eos_token_ids == (2,)  # config's
    for o in out:
        assert len(o.token_ids) == 4 and all(0 <= t < 128 for t in o.token_ids)
        assert all(np.isfinite(v) for lp in o.logprobs for v in lp.values())
        assert o.text.split() == [f"<{t}>" for t in o.token_ids]


def test_serve_builds_a_dummy_engine(checkpoint):
    serve = script("serve")
    args = serve.build_parser().parse_args(
        [
            "--model",
            checkpoint[1],
            "--load-format",
            "dummy",
            "--page-size",
            "4",
            "--num-pages",
            "16",
            "--max-model-len",
            "32",
            "--max-num-seqs",
            "2",
            "--max-num-batched-tokens",
            "8",
        ]
    )
    from serving.launch import build_core, frontend_model

    eargs = serve.engine_args(args)
    assert frontend_model(eargs).params is None  # the front end reads no weights
    core = build_core(eargs)
    assert core.runner.params is not None and core.config.num_pages == 16
    load_format = next(a for a in serve.build_parser()._actions if a.dest == "load_format")
    assert tuple(load_format.choices) == LOAD_FORMATS
    assert "load_format" in serve.ENGINE_FLAGS  # multi-host: every process on process 0's choice
    with pytest.raises(SystemExit):
        serve.build_parser().parse_args(["--load-format", "bogus"])


def test_bad_load_format_and_missing_config_raise(checkpoint, tmp_path):
    from jaxinfer import LLM

    with pytest.raises(ValueError, match="'bogus'"):
        load_model(checkpoint[1], load_format="bogus")
    with pytest.raises(ValueError, match="'bogus'"):
        LLM(checkpoint[1], load_format="bogus")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(str(tmp_path), load_format="dummy")


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_leaves_in_their_own_programs_keep_their_values(checkpoint, monkeypatch, quantization):
    """A leaf larger than `OWN_PROGRAM_BYTES` is drawn by its own program (one program for all
    kept every leaf's f32 draws live: 35 GB for the int8 4B Gemma 3): the same values, dtypes and
    shardings as the one program of all leaves, on a `tensor=4` mesh."""
    from jaxinfer import params as params_lib

    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (tests/conftest.py sets 8 virtual CPU devices)")
    _, bare_dir, _ = checkpoint
    mesh = shd.make_mesh("tensor=4", devices=jax.devices()[:4])
    one = load_model(bare_dir, dtype="float32", mesh=mesh, load_format="dummy",
                     quantization=quantization)  # fmt: skip
    monkeypatch.setattr(params_lib, "OWN_PROGRAM_BYTES", 4 * 64)
    own = params_lib._init_program.cache_info().currsize
    each = load_model(bare_dir, dtype="float32", mesh=mesh, load_format="dummy",
                      quantization=quantization)  # fmt: skip
    assert params_lib._init_program.cache_info().currsize > own
    for (path, x), (_, y) in zip(_leaves(each.params), _leaves(one.params), strict=True):
        name = jax.tree_util.keystr(path)
        assert x.dtype == y.dtype and x.sharding.is_equivalent_to(y.sharding, x.ndim), name
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
