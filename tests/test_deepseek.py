"""DeepSeek-V2 / V3 (MLA + MoE with shared experts) on tiny random models.

1. Logit parity with HF transformers (f32, <= 1e-4 of the logit scale): prefill, prefill + paged
   decode, two sequences in one ragged step, chunked prefill; V3 (q_lora, sigmoid + correction
   bias, noaux_tc groups, YaRN mscale, routed scaling) and V2 (no q_lora, softmax,
   group-limited greedy, two shared experts).
2. The model with the GPU MLA kernel (Pallas interpret mode) equals the reference backend.
3. The paged cache holds only the latent rows: per token and layer (kv_lora_rank +
   qk_rope_head_dim) values; the engine sizes its pages by those bytes.
4. On 8 virtual CPU devices, expert x tensor and data x tensor meshes give the single-device logits.
5. Config fields we do not implement are refused by name; MTP layers are skipped at load, other
   unknown tensors raise.
6. `load_format="dummy"` from a config.json alone: the real load's tree and shardings; the engine
   generates over it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import moe
from jaxinfer import params as params_lib
from jaxinfer import sharding as shd
from jaxinfer.config import EngineConfig, ModelConfig, UnsupportedConfigError
from jaxinfer.engine.engine import LLMEngine, wait_all
from jaxinfer.model_info import LoadedModel
from jaxinfer.models import deepseek, family_of
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.step import StepInputs, build_step_arrays
from tests.model_utils import DEEPSEEK_FAMILIES, PagedStepper, hf_config_dict, rel_err

TOL = 1e-4  # of the logit scale, f32


def _tokens(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


@pytest.fixture(scope="module", params=sorted(DEEPSEEK_FAMILIES))
def family(request):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.model_utils import make_hf_model, params_from_torch

    model, _ = make_hf_model(request.param)
    cfg = ModelConfig.from_hf(hf_config_dict(request.param))
    return request.param, model, cfg, params_from_torch(model, cfg)


def _hf(model, toks):
    from tests.model_utils import hf_logits

    return hf_logits(model, toks)


def test_prefill(family):
    name, model, cfg, params = family
    assert family_of(cfg) is deepseek
    toks = _tokens(16, 1)  # the decodes' 16-token bucket: one program per family
    (ours,) = PagedStepper(params, cfg).step([(0, toks)])
    err = rel_err(ours, _hf(model, toks))
    print(f"{name}: prefill parity error {err:.2e}")
    assert err <= TOL


def test_prefill_then_paged_decode(family):
    name, model, cfg, params = family
    toks = _tokens(22, 2)
    stepper = PagedStepper(params, cfg, page_size=4)
    got = stepper.step([(0, toks[:14])])
    for i in range(14, 22):
        got.extend(stepper.step([(0, [toks[i]])]))
    err = rel_err(np.concatenate(got), _hf(model, toks))
    print(f"{name}: prefill + decode parity error {err:.2e}")
    assert err <= TOL


def test_two_sequences_one_ragged_step(family):
    _, model, cfg, params = family
    a, b = _tokens(10, 3), _tokens(5, 4)  # 10 + 5 + 1 padding: the 16-token bucket
    out_a, out_b = PagedStepper(params, cfg).step([(0, a), (1, b)], pad_tokens=1, pad_seqs=1)
    assert rel_err(out_a, _hf(model, a)) <= TOL
    assert rel_err(out_b, _hf(model, b)) <= TOL


def test_chunked_prefill_beside_a_decode(family):
    _, model, cfg, params = family
    a, b = _tokens(17, 5), _tokens(10, 6)
    stepper = PagedStepper(params, cfg, page_size=4, seed=3)
    got_a = stepper.step([(0, a[:5])])
    got_b = []
    for i in range(5):  # b decodes token by token while a prefills in chunks of 3 (then 0)
        chunk = a[5 + 3 * i : 8 + 3 * i]
        step = [(1, b[:6])] if i == 0 else [(1, [b[5 + i]])]
        out = stepper.step(step + ([(0, chunk)] if chunk else []))
        got_b.append(out[0])
        if chunk:
            got_a.append(out[1])
    assert rel_err(np.concatenate(got_a), _hf(model, a)) <= TOL
    assert rel_err(np.concatenate(got_b), _hf(model, b[:10])) <= TOL


def test_gpu_mla_kernel_in_the_model_equals_reference(family):
    _, _, cfg, params = family
    toks = _tokens(11, 7)
    runs = []
    for backend in ("reference", "gpu"):  # "gpu": Pallas interpret mode on a CPU platform
        stepper = PagedStepper(params, cfg, page_size=4, attention_backend=backend)
        out = stepper.step([(0, toks[:9])])
        out += stepper.step([(0, toks[9:10])]) + stepper.step([(0, toks[10:])])
        runs.append(np.concatenate(out))
    assert rel_err(runs[1], runs[0]) <= 1e-5


def _random_model(name="deepseek_v3", **overrides):
    cfg = ModelConfig.from_hf({**hf_config_dict(name), **overrides})
    params = params_lib.init_random(deepseek.param_specs(cfg), jax.random.key(0))
    params = jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, params)
    return cfg, params


# NOTE: the mesh tests' model: the dense first layer and one MoE layer (of the tiny config's
# three), so each sharded program is two thirds the size.
MESH_LAYERS = 2


def test_cache_holds_only_latent_rows_and_engine_sizes_pages_by_them():
    cfg, params = _random_model()
    lat, rope, layers = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_layers
    per_token = (lat + rope) * 4 * layers  # f32
    assert deepseek.kv_cache_bytes_per_token(cfg, shd.Parallel(), 4) == per_token
    model = LoadedModel("tiny-ds", "<memory>", "random", cfg, {}, params, None, "float32")
    budget = 37 * 4 * per_token + 5
    engine = LLMEngine(
        model,
        EngineConfig(
            page_size=4,
            kv_cache_memory=budget,
            max_model_len=256,
            max_num_seqs=8,
            max_num_batched_tokens=8,
        ),
    )
    assert engine.config.num_pages == 37
    assert all(c.shape == (37, 4, lat + rope) for c in engine.runner.kv_caches)
    assert engine.runner.kv_cache_bytes == 37 * 4 * per_token


def _step(seqs, data=1):
    arrays = [
        build_step_arrays(
            s, 4, num_tokens=16, num_seqs=4, pages_per_seq=8, logits_rows=None, num_logits=4
        )
        for s in seqs
    ]
    stacked = {k: np.stack([a[k] for a in arrays]) if data > 1 else arrays[0][k] for k in arrays[0]}
    return StepInputs(**{k: jnp.asarray(v) for k, v in stacked.items()})


@pytest.mark.parametrize(
    "spec,a2a", [("expert=2,tensor=2", False), ("data=2,tensor=2", False), ("expert=4", True)]
)
def test_mesh_equals_single_device(spec, a2a, monkeypatch):
    """Heads over expert x tensor, experts over expert; `a2a`: every step takes the all_to_all
    dispatch (the router bias travels with the routing)."""
    if a2a:
        monkeypatch.setattr(moe, "A2A_MIN_TOKENS", 16)
        jax.clear_caches()
    cfg, params = _random_model(num_hidden_layers=MESH_LAYERS)
    devices = jax.devices()[:4]
    if len(devices) < 4:
        pytest.skip("needs 4 (virtual) devices")
    mesh = shd.make_mesh(spec, devices=devices)
    par = shd.Parallel.from_mesh(mesh)
    shd.check_mesh(cfg, spec, num_devices=4)
    prefill = [
        [(_tokens(10, 1), 0, [3, 5, 7]), (_tokens(3, 2), 0, [1])],
        [(_tokens(6, 3), 0, [2, 0]), (_tokens(9, 4), 0, [4, 6, 9])],
    ]
    decode = [
        [(_tokens(1, 5), 10, [3, 5, 7]), (_tokens(1, 6), 3, [1])],
        [(_tokens(1, 7), 6, [2, 0]), (_tokens(1, 8), 9, [4, 6, 9])],
    ]
    shape = deepseek.kv_cache_shape(cfg, "reference", 12, 4)
    want = []
    for r in range(par.data):
        caches = tuple(jnp.zeros(shape) for _ in range(cfg.num_layers))
        for seqs in (prefill, decode):
            logits, caches = deepseek.forward_jit(params, cfg, _step([seqs[r]]), caches)
            want.append(np.asarray(logits))
    rules = shd.model_rules(cfg, par)
    sharded = jax.device_put(params, params_lib.shardings(deepseek.param_specs(cfg), mesh, rules))
    caches = tuple(jnp.zeros((par.data * shape[0], *shape[1:])) for _ in range(cfg.num_layers))
    got = []
    for seqs in (prefill, decode):
        logits, caches = deepseek.forward_jit(
            sharded, cfg, _step(seqs[: par.data], par.data), caches, mesh=mesh
        )
        got.append(np.asarray(logits))
    if par.data > 1:  # [data, N, V] -> per replica, in the order `want` holds them
        got = [g[r] for r in range(par.data) for g in got]
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 1e-4
    if a2a:
        jax.clear_caches()  # no later test may reuse a program traced with the patched threshold


@pytest.mark.slow
def test_engine_greedy_tokens_on_mesh_equal_single_device():
    """The engine (runner on a mesh: latent caches replicated over the head shards) generates the
    single-device greedy tokens; no tokenizer (token ids only)."""
    cfg, params = _random_model(num_hidden_layers=MESH_LAYERS)
    model = LoadedModel("tiny-ds", "<memory>", "random", cfg, {}, params, None, "float32")
    prompts = [_tokens(n, s) for s, n in ((1, 9), (2, 4), (3, 13))]

    def tokens(mesh):
        # NOTE: the 26 prompt tokens prefill in one 32-token step and the three requests decode
        # together, padded to the same one bucket: one program per engine (a 16-token budget
        # compiled three, two buckets two).
        engine = LLMEngine(
            model,
            EngineConfig(
                page_size=4,
                num_pages=40,
                max_model_len=64,
                max_num_seqs=4,
                max_num_batched_tokens=32,
                token_buckets=(32,),
                mesh=mesh,
            ),
        )
        for i, p in enumerate(prompts):
            engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=8), request_id=str(i))
        out = {str(i): [] for i in range(len(prompts))}
        for delta in wait_all(engine):
            out[delta.request_id] += delta.new_token_ids
            assert delta.new_text == ""
        return out

    assert tokens("data=2,expert=2,tensor=2") == tokens("")


def test_pipeline_mesh_is_refused():
    cfg, params = _random_model()
    with pytest.raises(ValueError, match="pipeline=1"):
        shd.check_mesh(cfg, "pipeline=2,tensor=4", num_devices=8)
    mesh = shd.make_mesh("pipeline=2", devices=jax.devices()[:2])
    with pytest.raises(ValueError, match="pipeline"):
        deepseek.forward(
            params,
            cfg,
            _step([[(_tokens(3, 1), 0, [0])]]),
            (jnp.zeros(deepseek.kv_cache_shape(cfg, None, 4, 4)),) * 3,
            mesh=mesh,
        )


def test_config_fields():
    v3 = ModelConfig.from_hf(hf_config_dict("deepseek_v3"))
    assert v3.is_mla and v3.head_dim == 24 and v3.num_kv_heads == v3.num_heads
    assert v3.moe_layers == (False, True, True) and v3.num_shared_experts == 1
    assert (v3.scoring_func, v3.topk_method, v3.n_group, v3.topk_group) == (
        "sigmoid",
        "noaux_tc",
        4,
        2,
    )
    mscale = 0.1 * np.log(4.0) + 1.0  # YaRN mscale_all_dim=1: the softmax scale carries mscale^2
    assert v3.sm_scale == pytest.approx(24**-0.5 * mscale**2)
    v2 = ModelConfig.from_hf(hf_config_dict("deepseek_v2"))
    assert (v2.q_lora_rank, v2.scoring_func, v2.topk_method) == (
        0,
        "softmax",
        "group_limited_greedy",
    )
    greedy = ModelConfig.from_hf({**hf_config_dict("deepseek_v2"), "topk_method": "greedy"})
    assert (greedy.n_group, greedy.topk_group) == (1, 1)  # greedy ignores the groups, as HF does


@pytest.mark.parametrize(
    "name,overrides,match",
    [
        ("deepseek_v3", dict(topk_method="group_limited_greedy"), "topk_method"),
        ("deepseek_v2", dict(scoring_func="sigmoid"), "scoring_func"),
        ("deepseek_v2", dict(topk_method="weird"), "topk_method"),
        ("deepseek_v3", dict(n_group=3), "n_group"),
        ("deepseek_v3", dict(num_key_value_heads=2), "num_key_value_heads"),
        ("deepseek_v3", dict(attention_bias=True), "attention_bias"),
        ("deepseek_v3", dict(moe_expert_capacity=4), "moe_expert_capacity"),
        ("deepseek_v3", dict(num_experts_per_tok=5), "num_experts_per_tok"),
        ("deepseek_v3", dict(kv_lora_rank=None), "kv_lora_rank"),
        ("deepseek_v3", dict(rope_scaling=dict(rope_type="dynamic", factor=2.0)), "dynamic"),
    ],
)
def test_bad_config_fields_are_refused_by_name(name, overrides, match):
    with pytest.raises(UnsupportedConfigError, match=match):
        ModelConfig.from_hf({**hf_config_dict(name), **overrides})


def test_mtp_layers_are_skipped_and_unknown_tensors_raise():
    cfg, params = _random_model(num_nextn_predict_layers=1)
    specs = deepseek.param_specs(cfg)
    names = list(deepseek._hf_name_map(cfg, []))
    fake = {n: None for n in names}

    def get(name):  # any tensor of the right shape: map each name through its own transform
        raise AssertionError("not read")

    extra = ["model.layers.3.eh_proj.weight", "model.layers.3.mlp.gate.weight"]
    with pytest.raises(AssertionError, match="not read"):  # gets past the name checks
        deepseek.params_from_hf(cfg, [*fake, *extra], get)
    with pytest.raises(ValueError, match="model.layers.4.eh_proj.weight"):
        deepseek.params_from_hf(cfg, [*fake, "model.layers.4.eh_proj.weight"], get)
    no_mtp = dataclasses.replace(cfg, num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match="unexpected tensors"):
        deepseek.params_from_hf(no_mtp, [*fake, *extra], get)
    assert specs.layers[1].mlp.router_bias.shape == (8,)


@pytest.mark.parametrize("num_tokens,num_seqs,pages_per_seq", [(1, 1, 16), (1, 1, 12), (32, 4, 16)])
def test_latent_cache_is_updated_in_place(num_tokens, num_seqs, pages_per_seq):
    """The compiled step writes the donated latent caches in place (no whole-cache copy)."""
    cfg = ModelConfig.from_hf(hf_config_dict("deepseek_v3"))
    shape = deepseek.kv_cache_shape(cfg, "reference", 1024, 16)
    caches = tuple(jax.ShapeDtypeStruct(shape, jnp.float32) for _ in range(cfg.num_layers))
    arrays = build_step_arrays(
        [(list(range(num_tokens)), 3, list(range(1, 9)))],
        16,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        pages_per_seq=pages_per_seq,
    )
    step = StepInputs(**{k: jnp.asarray(v) for k, v in arrays.items()})
    hlo = (
        deepseek.forward_jit.lower(
            params_lib.abstract(deepseek.param_specs(cfg)), cfg, step, caches
        )
        .compile()
        .as_text()
    )
    dims = ",".join(map(str, shape))
    entry = hlo[hlo.find("ENTRY") :]
    assert not [line for line in entry.splitlines() if " copy(" in line and f"[{dims}]" in line]


HUB_V3 = {  # deepseek-ai/DeepSeek-V3 config.json (auto_map left out)"architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}
HUB_V2_LITE = {  # deepseek-ai/DeepSeek-V2-Lite config.json (auto_map left out)"architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 10944,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "pretraining_tp": 1,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "greedy",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 102400,
}


@pytest.mark.parametrize(
    "hf,billions,kv_bytes", [(HUB_V3, 671.0, 70272), (HUB_V2_LITE, 15.7, 31104)]
)
def test_hub_configs_parse_and_count_the_published_parameters(hf, billions, kv_bytes):
    """The hub's own config.json fields parse (training-only ones ignored, MTP layers counted out)
    and give the published sizes; bf16 latent cache bytes per token over all layers."""
    cfg = ModelConfig.from_hf(hf)
    assert cfg.num_params() / 1e9 == pytest.approx(billions, abs=0.05)
    assert deepseek.kv_cache_bytes_per_token(cfg, shd.Parallel(), 2) == kv_bytes


@pytest.mark.parametrize(
    "mesh,generate",
    [
        pytest.param("", "placeholder", marks=pytest.mark.slow),  # the engine's programs (~40 s)
        ("data=2,expert=2,tensor=2", None),
    ],
)
def test_dummy_load_matches_a_real_load(tmp_path, mesh, generate):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.model_utils import check_dummy_load

    check_dummy_load("deepseek_v3", tmp_path, mesh, generate)
