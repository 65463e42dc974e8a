"""Gemma 3 config parsing, chunked prefill against HF and the mesh (prefill, paged decode and
ragged-batch parity are in tests/test_model_parity.py, chunked == unchunked in
tests/test_consistency.py).

1. The hub's config.json form (`sliding_window_pattern`, `rope_theta` + `rope_scaling`,
   `rope_local_base_freq`) and transformers 5's form (`layer_types`, per-layer-type
   `rope_parameters`) give the same `ModelConfig`.
2. The multimodal `gemma3` wrapper is read through its `text_config`.
3. Bad fields are refused by name.
4. Chunked prefill beside decodes, past the 8-token window, matches HF's logits (f32, <= 1e-4),
   also with soft caps configured (the final one applied; the attention one is not applied by
   transformers' Gemma 3, nor by us, with a warning).
5. On `tensor=2` and `data=2,tensor=2` meshes the forward gives the single-device logits.
6. `load_format="dummy"` from a config.json alone: the real load's tree and shardings.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import params as params_lib
from jaxinfer import sharding as shd
from jaxinfer.config import ModelConfig, UnsupportedConfigError
from jaxinfer.models import llama
from jaxinfer.step import StepInputs, build_step_arrays
from tests.model_utils import PagedStepper, hf_config_dict, rel_err

TOL = 1e-4  # of the logit scale, f32


def _tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


def _hub_config(**overrides) -> dict:
    return {**hf_config_dict("gemma3"), "num_hidden_layers": 7, **overrides}


def test_default_pattern_is_five_local_one_global():
    hf = _hub_config()
    del hf["sliding_window_pattern"]
    cfg = ModelConfig.from_hf(hf)
    assert cfg.layer_windows == (8, 8, 8, 8, 8, None, 8)
    assert cfg.local_rope.theta == 100.0 and cfg.local_rope.rope_type == "default"
    assert cfg.rope.theta == 1e6 and cfg.rope.rope_type == "linear"
    assert cfg.qk_norm and cfg.sandwich_norm and cfg.embed_scale and cfg.norm_offset == 1.0
    assert cfg.sm_scale == 24.0**-0.5


def test_transformers5_form_matches_hub_form():
    transformers = pytest.importorskip("transformers")
    hub = _hub_config()
    fields = {k: v for k, v in hub.items() if k != "model_type"}
    written = transformers.Gemma3TextConfig(**fields).to_dict()
    assert "layer_types" in written and "full_attention" in written["rope_parameters"]
    assert ModelConfig.from_hf(written) == ModelConfig.from_hf(hub)


def test_layer_types_override_the_pattern():
    kinds = ["full_attention", "sliding_attention"] * 3 + ["full_attention"]
    cfg = ModelConfig.from_hf(_hub_config(layer_types=kinds))
    assert cfg.layer_windows == (None, 8, None, 8, None, 8, None)


def test_defaults_when_fields_are_absent():
    hf = _hub_config()
    for key in ("rope_theta", "rope_local_base_freq", "query_pre_attn_scalar", "rope_scaling"):
        del hf[key]
    cfg = ModelConfig.from_hf(hf)
    assert (cfg.rope.theta, cfg.local_rope.theta) == (1e6, 10000.0)  # HF Gemma3TextConfig's
    assert cfg.sm_scale == 256**-0.5


def test_multimodal_wrapper_reads_text_config():
    text = {k: v for k, v in _hub_config().items() if k != "model_type"}
    wrapper = {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": {**text, "model_type": "gemma3_text"},
        "vision_config": {"model_type": "siglip_vision_model"},
    }
    assert ModelConfig.from_hf(wrapper) == ModelConfig.from_hf(_hub_config())


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(sliding_window_pattern=0), "sliding_window_pattern"),
        (dict(layer_types=["sliding_attention"] * 3), "layer_types"),
        (dict(rope_scaling=dict(rope_type="dynamic", factor=2.0)), "dynamic"),
        (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ],
)
def test_bad_fields_are_refused_by_name(overrides, match):
    with pytest.raises(UnsupportedConfigError, match=match):
        ModelConfig.from_hf(_hub_config(**overrides))


def test_multimodal_checkpoint_loads_its_text_model(tmp_path):
    """A Gemma3ForConditionalGeneration dir (no tokenizer): the text model's logits match HF."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import numpy as np

    from jaxinfer.loader import load_model

    text = {k: v for k, v in hf_config_dict("gemma3").items() if k != "model_type"}
    vision = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name:
                p.copy_((0.1 if p.ndim == 1 else 0.15) * torch.randn(p.shape))
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, skip_tokenizer_init=True)
    assert loaded.cfg == ModelConfig.from_hf(hf_config_dict("gemma3"))
    toks = [int(t) for t in np.random.default_rng(0).integers(0, 256, 12)]
    with torch.no_grad():
        ref = model(torch.tensor([toks])).logits[0].float().numpy()
    (ours,) = PagedStepper(loaded.params, loaded.cfg).step([(0, toks)])
    assert rel_err(ours, ref) <= 1e-4


@pytest.mark.parametrize(
    "caps",
    [{}, dict(attn_logit_softcapping=20.0, final_logit_softcapping=5.0)],
    ids=["plain", "soft_caps"],
)
def test_chunked_prefill_beside_a_decode_matches_hf(caps):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.model_utils import hf_logits, make_hf_model, params_from_torch

    model, _ = make_hf_model("gemma3", **caps)
    cfg = ModelConfig.from_hf({**hf_config_dict("gemma3"), **caps})
    # transformers' Gemma 3 never applies attn_logit_softcapping; the final cap it does apply
    assert cfg.attn_logit_softcap is None
    assert cfg.final_logit_softcap == caps.get("final_logit_softcapping")
    params = params_from_torch(model, cfg)
    a, b = _tokens(23, 5), _tokens(16, 6)
    stepper = PagedStepper(params, cfg, page_size=4, seed=3)
    got_a, got_b = stepper.step([(0, a[:5])]), []
    for i in range(6):  # b decodes token by token while a prefills in chunks of 3 (then 0)
        chunk = a[5 + 3 * i : 8 + 3 * i]
        step = [(1, b[:11])] if i == 0 else [(1, [b[10 + i]])]
        out = stepper.step(step + ([(0, chunk)] if chunk else []))
        got_b.append(out[0])
        if chunk:
            got_a.append(out[1])
    err_a = rel_err(np.concatenate(got_a), hf_logits(model, a))
    err_b = rel_err(np.concatenate(got_b), hf_logits(model, b))
    print(f"gemma3 {caps}: chunked prefill parity error {max(err_a, err_b):.2e}")
    assert err_a <= TOL and err_b <= TOL


def _mesh_step(seqs, data):
    arrays = [build_step_arrays(s, 4, num_tokens=16, num_seqs=4, pages_per_seq=8) for s in seqs]
    stacked = {k: np.stack([a[k] for a in arrays]) if data > 1 else arrays[0][k] for k in arrays[0]}
    return StepInputs(**{k: jnp.asarray(v) for k, v in stacked.items()})


@pytest.mark.parametrize("spec", ["tensor=2", "data=2,tensor=2"])
def test_mesh_equals_single_device(spec):
    cfg = ModelConfig.from_hf(hf_config_dict("gemma3"))
    params = params_lib.init_random(llama.param_specs(cfg), jax.random.key(0))
    params = jax.tree.map(lambda x: x * 4.0, params)  # peaky logits
    mesh = shd.make_mesh(spec, devices=jax.devices()[: 4 if "data" in spec else 2])
    par = shd.Parallel.from_mesh(mesh)
    prefill = [
        [(_tokens(12, 1), 0, [3, 5, 7]), (_tokens(3, 2), 0, [1])],
        [(_tokens(10, 3), 0, [2, 0, 8]), (_tokens(5, 4), 0, [4, 6])],
    ]
    decode = [
        [(_tokens(1, 5), 12, [3, 5, 7, 9]), (_tokens(1, 6), 3, [1])],
        [(_tokens(1, 7), 10, [2, 0, 8]), (_tokens(1, 8), 5, [4, 6])],
    ]
    shape = llama.kv_cache_shape(cfg, "reference", 12, 4)
    want = []
    for r in range(par.data):
        caches = tuple(jnp.zeros(shape) for _ in range(cfg.num_layers))
        for seqs in (prefill, decode):
            logits, caches = llama.forward_jit(params, cfg, _mesh_step([seqs[r]], 1), caches)
            want.append(np.asarray(logits))
    rules = shd.model_rules(cfg, par)
    sharded = jax.device_put(params, params_lib.shardings(llama.param_specs(cfg), mesh, rules))
    gshape = llama.kv_cache_shape(cfg, "reference", par.data * 12, 4, par)
    caches = tuple(
        jax.device_put(
            jnp.zeros(gshape), jax.sharding.NamedSharding(mesh, llama.kv_cache_spec(cfg, par))
        )
        for _ in range(cfg.num_layers)
    )
    got = []
    for seqs in (prefill, decode):
        logits, caches = llama.forward_jit(
            sharded, cfg, _mesh_step(seqs[: par.data], par.data), caches, mesh=mesh
        )
        got.append(np.asarray(logits))
    if par.data > 1:  # [data, N, V] -> per replica, in the order `want` holds them
        got = [g[r] for r in range(par.data) for g in got]
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 1e-4


def test_dummy_load_matches_a_real_load(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.model_utils import check_dummy_load

    check_dummy_load("gemma3", tmp_path, "data=4,tensor=2")
