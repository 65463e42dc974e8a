"""GPTQ and AWQ checkpoints load as int4, 8-bit GPTQ as int8 (`checkpoints.hf_quant`).

1. A tiny random Llama is quantized to 4 bits per group of 32 (f16 scales, integer zero points;
   8-bit: symmetric, zero 128) and packed from the formats' documented layouts
   (`tests/packed_checkpoints.py`); each loads through `load_model` with no quantization asked,
   as "int4-g32" ("int8-g32").
2. Every packed linear dequantizes to the packer's (code - zero) * scale up to the f16 rounding
   of its offset -zero * scale (int4 stores scales and offsets as f16: the scale is exact, the
   offset off by at most 2^-11 of itself, <= 1/128 of a quantization step; int8 exactly), and the
   model's logits equal the float model on its dequantized weights (the embedding is int8 on
   both sides) within 1e-4.
3. Anything else in `quantization_config` is refused by name, and so is a g_idx whose groups are
   not consecutive rows under desc_act=False, and an 8-bit zero point that leaves codes outside
   int8. GPTQ's act-order (desc_act=True, `write_packed(act_order=True)`: each input's channels
   quantized in a random order) loads as "-act": each linear's rows sorted into its groups and
   x gathered through the permutation (`QArray.perm`), the same logits as the dequantized
   weights on XLA's products and the CPU kernel's; unequal groups, fused linears with different
   g_idx and a mesh splitting a permuted weight's input channels are refused by name.
4. vLLM's `quantization` names of these formats ("gptq", "awq", their "_marlin" variants) load
   such a checkpoint as it is (random weights in its format with `load_format="dummy"`, asked
   for or not) and are
   refused, naming the field, for a checkpoint of the other method or none.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from checkpoints.errors import CheckpointError
from jaxinfer import params as params_lib
from jaxinfer import quantization
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.loader import load_model
from jaxinfer.models import llama
from pallas_kernels.linear import cpu as cpu_linear
from tests.model_utils import make_hf_model, rel_err
from tests.packed_checkpoints import GROUP, pack, write_packed
from tests.test_quantization import _dequantized, _run


@pytest.fixture(scope="module")
def tiny():
    model, config = make_hf_model("llama", intermediate_size=128)
    sd = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    return config.to_dict(), sd


@pytest.mark.parametrize(
    "method,bits,act",
    [
        ("gptq", 4, False),
        ("awq", 4, False),
        ("gptq", 8, False),
        ("gptq", 4, True),
        ("gptq", 8, True),
    ],
)
def test_packed_checkpoint_loads_quantized_and_matches_its_dequantized_weights(
    tmp_path, tiny, method, bits, act
):
    config, sd = tiny
    dequantized = write_packed(tmp_path, config, sd, method, bits, act_order=act)
    fmt = ("int8-g32" if bits == 8 else "int4-g32") + ("-act" if act else "")
    loaded = load_model(str(tmp_path), skip_tokenizer_init=True)
    assert loaded.quantization == fmt
    params, cfg = loaded.params, loaded.cfg
    assert quantization.quantization_of(params) == fmt
    specs = llama.param_specs(cfg, quantization=fmt)
    layer = params.layers[1]

    def offset_rounding(leaf) -> np.ndarray:  # the bound on |stored - exact| of each value
        assert (leaf.perm is not None) == act
        if bits == 8:  # int8 codes - zero and the f16 scale widened to f32: exact
            assert leaf.offset is None and leaf.scale.dtype == np.float32
            return np.zeros(leaf.data.shape)
        assert leaf.scale.dtype == leaf.offset.dtype == np.float16
        offset = np.abs(np.asarray(leaf.offset, np.float32))
        bound = np.repeat(offset, GROUP, axis=0) * 2.0**-11 + 1e-7  # stored rows
        return bound if leaf.perm is None else bound[np.argsort(np.asarray(leaf.perm))]

    for leaf, name in ((layer.attn.o, "o_proj"), (layer.mlp.down, "down_proj")):
        want = dequantized[
            f"model.layers.1.{'self_attn' if name == 'o_proj' else 'mlp'}.{name}.weight"
        ]
        got = np.asarray(quantization.dequantize(leaf, 0))
        assert np.all(np.abs(got - want.T) <= offset_rounding(leaf)), name
    gu = np.asarray(quantization.dequantize(layer.mlp.gate_up, 0))  # fused [E, 2, F]
    up = dequantized["model.layers.1.mlp.up_proj.weight"].T
    assert np.all(np.abs(gu[:, 1] - up) <= offset_rounding(layer.mlp.gate_up)[:, 1])
    assert jax.tree.structure(params) == jax.tree.structure(
        jax.tree.map(lambda s: 0, specs, is_leaf=params_lib.is_spec)
    )
    want = _run(_dequantized(cfg, params), cfg)
    assert max(rel_err(g, w) for g, w in zip(_run(params, cfg), want)) <= 1e-4
    if act and cpu_linear.available():  # the compiled kernel's products (int4: on 15-bit x)
        got = _run(params, cfg, linear_backend="cpu")
        assert max(rel_err(g, w) for g, w in zip(got, want)) <= (2e-3 if bits == 4 else 1e-4)


@pytest.mark.parametrize(
    "qc,match",
    [
        ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'"),
        ({"quant_method": "gptq", "bits": 3}, "bits=3"),
        ({"quant_method": "awq", "bits": 8, "version": "gemm"}, "bits=8"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version='gemv'"),
        ({"quant_method": "gptq", "bits": 4, "group_size": -1}, "group_size=-1"),
    ],
)
def test_other_quantization_configs_are_refused_by_name(tmp_path, tiny, qc, match):
    config, sd = tiny
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    save_file({k: v for k, v in sd.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=match):
        load_model(str(tmp_path), skip_tokenizer_init=True)


def test_act_order_groups_that_are_not_consecutive_are_refused(tmp_path, tiny):
    config, sd = tiny
    write_packed(tmp_path, config, sd, "gptq")
    from safetensors.numpy import load_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.g_idx"
    tensors[name] = np.roll(tensors[name], 1)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="g_idx.*desc_act"):
        load_model(str(tmp_path), skip_tokenizer_init=True)


def _edit_tensors(root, edit) -> None:
    from safetensors.numpy import load_file

    tensors = load_file(str(root / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(root / "model.safetensors"))


def test_act_order_refusals_name_the_tensor_or_the_mesh(tmp_path, tiny):
    """Act-order loads need groups of exactly group_size rows, one g_idx for the linears fused
    into one weight (they read the same input), and a mesh that does not split the input channels
    of a weight it permutes (o_proj / down_proj under tensor parallelism)."""
    from jaxinfer import sharding as shd

    config, sd = tiny
    root = tmp_path / "a"
    root.mkdir()
    write_packed(root, config, sd, "gptq", act_order=True)
    name = "model.layers.0.self_attn.k_proj.g_idx"

    def uneven(t):  # one row moved to another group: 31 and 33 rows
        t[name] = t[name].copy()
        t[name][np.argmax(t[name] == 0)] = 1

    _edit_tensors(root, uneven)
    with pytest.raises(CheckpointError, match="k_proj.g_idx: act-order groups of other than 32"):
        load_model(str(root), skip_tokenizer_init=True)
    write_packed(root, config, sd, "gptq", act_order=True)

    def other_order(t):  # k_proj's rows in another (valid) act order than q_proj's
        k = t[name].shape[0]
        t[name] = (np.arange(k) // GROUP).astype(np.int32)

    _edit_tensors(root, other_order)
    with pytest.raises(ValueError, match="k_proj.*act-order permutation.*differs"):
        load_model(str(root), skip_tokenizer_init=True)
    write_packed(root, config, sd, "gptq", act_order=True)
    with pytest.raises(ValueError, match=r"weight .layers\[0\].attn.o has .*axes \('tensor',\)"):
        load_model(str(root), skip_tokenizer_init=True, mesh=shd.make_mesh("data=4,tensor=2"))
    loaded = load_model(str(root), skip_tokenizer_init=True, mesh=shd.make_mesh("data=8"))
    assert loaded.quantization == "int4-g32-act"


def test_act_order_is_a_checkpoints_layout_only(tmp_path, tiny):
    """Nothing quantizes float weights to an "-act" format (it names GPTQ's stored order), and a
    source that is no act-order GPTQ checkpoint refuses it by name."""
    (tmp_path / "config.json").write_text(json.dumps(tiny[0]))
    save_file(tiny[1], str(tmp_path / "model.safetensors"))
    cfg = ModelConfig.from_hf(tiny[0])
    specs = llama.param_specs(cfg)
    params = params_lib.init_random(specs, jax.random.key(0))
    with pytest.raises(ValueError, match="-act is an act-order GPTQ checkpoint's own layout"):
        quantization.quantize_params(params, specs, "int4-g32-act")
    with pytest.raises(CheckpointError, match="quantization='int4-g32-act': -act is the layout"):
        load_model(str(tmp_path), quantization="int4-g32-act", skip_tokenizer_init=True)
    act = quantization.quantize_specs(specs, "int4-g32-act")
    assert act.layers[0].attn.qkv.perm.shape == (cfg.hidden_size,)
    assert act.embed.perm is None  # the vocabulary-sized weights keep their order
    assert quantization.quantization_of(act) == "int4-g32-act"


def test_asymmetric_8bit_zero_points_are_refused_by_name(tmp_path, tiny):
    config, sd = tiny
    write_packed(tmp_path, config, sd, "gptq", 8)
    from safetensors.numpy import load_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.qzeros"
    tensors[name] = pack(np.full((4, 64), 9, np.uint8), 1, bits=8)  # zero 10 (v1: stored - 1)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="down_proj.weight.*zero points leave codes outside"):
        load_model(str(tmp_path), skip_tokenizer_init=True)


@pytest.mark.parametrize(
    "method,asked",
    [("gptq", "gptq"), ("gptq", "gptq_marlin"), ("awq", "awq"), ("awq", "awq_marlin")],
)
def test_vllm_method_names_load_their_checkpoint_as_it_is(tmp_path, tiny, method, asked):
    config, sd = tiny
    write_packed(tmp_path, config, sd, method)
    EngineConfig(quantization=asked)  # the engine's own check takes vLLM's name too
    asked_for = load_model(str(tmp_path), quantization=asked, skip_tokenizer_init=True)
    assert asked_for.quantization == "int4-g32"
    own = load_model(str(tmp_path), skip_tokenizer_init=True)
    for got, want in zip(jax.tree.leaves(asked_for.params), jax.tree.leaves(own.params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for ask in (asked, None):  # random weights in the checkpoint's format, asked or not
        dummy = load_model(
            str(tmp_path), quantization=ask, load_format="dummy", skip_tokenizer_init=True
        )
        assert quantization.quantization_of(dummy.params) == dummy.quantization == "int4-g32"


def test_vllm_method_names_refuse_other_checkpoints_by_name(tmp_path, tiny):
    config, sd = tiny
    (tmp_path / "gptq").mkdir()
    write_packed(tmp_path / "gptq", config, sd, "gptq")
    with pytest.raises(CheckpointError, match="is a gptq checkpoint .* or 'gptq'\\), not 'awq'"):
        load_model(str(tmp_path / "gptq"), quantization="awq", skip_tokenizer_init=True)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps(config))
    save_file(dict(sd), str(plain / "model.safetensors"))
    for load_format, asked in (("auto", "gptq_marlin"), ("dummy", "awq")):
        with pytest.raises(
            CheckpointError, match=f"quantization='{asked}' loads a .* no quantization_config"
        ):
            load_model(
                str(plain), quantization=asked, load_format=load_format, skip_tokenizer_init=True
            )
    with pytest.raises(ValueError, match="quantization='awq4' is not supported.*'awq_marlin'"):
        EngineConfig(quantization="awq4")


def test_none_asks_for_floats_and_a_packed_checkpoint_refuses_it(tmp_path, tiny):
    """`quantization="none"` (float weights; a GGUF file's blocks dequantized) loads a float
    checkpoint as floats and is refused, naming it, by a checkpoint that only loads packed."""
    config, sd = tiny
    write_packed(tmp_path, config, sd, "gptq")
    EngineConfig(quantization="none")
    with pytest.raises(CheckpointError, match="is a gptq checkpoint .* not 'none'"):
        load_model(str(tmp_path), quantization="none", skip_tokenizer_init=True)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps(config))
    save_file(dict(sd), str(plain / "model.safetensors"))
    for load_format in ("auto", "dummy"):
        floats = load_model(
            str(plain), quantization="none", load_format=load_format, skip_tokenizer_init=True
        )
        assert floats.quantization is None
        assert quantization.quantization_of(floats.params) is None
