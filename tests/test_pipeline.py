"""Pipeline parallelism: stage layout, stacked params, tick schedule, pipelined execution."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxinfer import pipeline
from jaxinfer import sharding as shd
from jaxinfer.config import ModelConfig, parse_mesh
from jaxinfer.models import llama
from jaxinfer.params import init_random, is_spec


def _mesh(spec: str):
    sizes = parse_mesh(spec)
    n = int(np.prod(list(sizes.values())))
    return shd.make_mesh(spec, jax.devices()[:n])


def test_check_stages_names_the_sizes_that_work():
    assert pipeline.check_stages(8, 4) == 2
    with pytest.raises(ValueError, match=r"pipeline=3 .* 8 layers.*\[1, 2, 4, 8\]"):
        pipeline.check_stages(8, 3)


def test_schedule_overlaps_stages():
    ticks = pipeline.schedule(num_microbatches=3, num_stages=2)
    assert ticks == [[(0, 0)], [(0, 1), (1, 0)], [(0, 2), (1, 1)], [(1, 2)]]
    ticks = pipeline.schedule(4, 4)
    assert len(ticks) == 4 + 4 - 1
    assert max(len(t) for t in ticks) == 4  # all stages busy at once in the steady state
    seen = [pair for t in ticks for pair in t]
    assert sorted(seen) == [(s, m) for s in range(4) for m in range(4)]  # each pair exactly once
    when = {pair: i for i, t in enumerate(ticks) for pair in t}
    for s in range(3):
        for m in range(4):
            assert when[(s + 1, m)] == when[(s, m)] + 1  # next stage, next tick


def test_split_microbatches_whole_sequences_balanced():
    assert pipeline.split_microbatches([1, 1, 1, 1, 8, 4], 2) == [[0, 1, 2, 3], [4, 5]]
    assert pipeline.split_microbatches([1, 1, 1, 1], 4) == [[0], [1], [2], [3]]
    assert pipeline.split_microbatches([5], 3) == [[], [0], []]
    assert pipeline.split_microbatches([], 2) == [[], []]
    rng = np.random.default_rng(0)
    for _ in range(50):
        counts = list(rng.integers(1, 20, rng.integers(1, 12)))
        groups = pipeline.split_microbatches(counts, 4)
        assert [i for g in groups for i in g] == list(range(len(counts)))  # contiguous, in order
        loads = [sum(counts[i] for i in g) for g in groups]
        assert max(loads) <= sum(counts) / 4 + max(counts)  # never worse than one sequence over


@pytest.mark.parametrize("num_stages,num_mb", [(4, 4), (2, 3), (4, 1)])
def test_run_pipeline_toy_matches_sequential(num_stages, num_mb):
    """Per-stage matmul + a per-stage state that accumulates what the stage saw."""
    mesh = _mesh(f"pipeline={num_stages}")
    e, t = 8, 5
    rng = np.random.default_rng(0)
    w = rng.normal(size=(num_stages, e, e)).astype(np.float32) / np.sqrt(e)
    x = rng.normal(size=(num_mb, t, e)).astype(np.float32)
    scale = rng.normal(size=(num_mb,)).astype(np.float32)
    state0 = np.zeros((num_stages, e), np.float32)

    def stage_fn(p, state, h, inp, active):
        h = jnp.tanh(h @ p) * inp
        return h, state + jnp.where(active, h.sum(0), 0.0)

    def body(w, state, scale, x):
        return pipeline.run_pipeline(
            stage_fn, w, state, scale, x, num_stages=num_stages, output_fn=lambda h, inp: h[:2]
        )

    run = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P("pipeline"), P("pipeline"), P(), P()),
            out_specs=(P(), P("pipeline")),
        )
    )
    out, state = run(w, state0, scale, x)

    ref_out, ref_state = [], state0.copy()
    for m in range(num_mb):
        h = x[m]
        for s in range(num_stages):
            h = np.tanh(h @ w[s]) * scale[m]
            ref_state[s] += h.sum(0)
        ref_out.append(h[:2])
    np.testing.assert_allclose(np.asarray(out), np.stack(ref_out), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(state), ref_state, rtol=1e-5, atol=1e-5)
    assert state.sharding.spec == P("pipeline")


def _rules(cfg, mesh):
    return shd.model_rules(cfg, shd.Parallel.from_mesh(mesh))  # as the loader and runner do


def _cfg(num_layers=8, kv_heads=2):
    return ModelConfig.from_hf(
        dict(
            model_type="llama",
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=num_layers,
            num_attention_heads=4,
            num_key_value_heads=kv_heads,
            head_dim=16,
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        )
    )


def test_stack_stages_specs_and_arrays_roundtrip():
    cfg = _cfg(8)
    specs = llama.param_specs(cfg)
    stacked = pipeline.stack_stages(specs, 4)
    assert len(stacked.layers) == 2
    o = stacked.layers[1].attn.o
    assert o.shape == (4, 64, 64) and o.logical_axes == ("layers", "q_heads", "embed")
    assert shd.logical_to_spec(o.logical_axes) == P("pipeline", ("expert", "tensor"), None)
    assert shd.logical_to_spec(o.logical_axes, shd.model_rules(cfg, shd.Parallel())) == P(
        "pipeline", "tensor", None
    )  # dense models: tensor alone
    assert stacked.embed == specs.embed
    assert pipeline.unstack_stages(stacked) == specs

    params = init_random(specs, jax.random.key(0))
    host = jax.tree.map(np.asarray, params)
    back = pipeline.unstack_stages(pipeline.stack_stages(host, 4))
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(host)):
        np.testing.assert_array_equal(a, b)
    # stage 2, slot 1 is canonical layer 5
    np.testing.assert_array_equal(
        pipeline.stack_stages(host, 4).layers[1].mlp.down[2], host.layers[5].mlp.down
    )
    with pytest.raises(ValueError, match="pipeline=3"):
        pipeline.stack_stages(specs, 3)


def test_stack_stages_rejects_mixed_layer_kinds():
    from tests.model_utils import hf_config_dict

    # Qwen3-MoE with decoder_sparse_step=2 over 4 layers: dense, MoE, dense, MoE
    cfg = ModelConfig.from_hf({**hf_config_dict("qwen3_moe_step2"), "num_hidden_layers": 4})
    specs = llama.param_specs(cfg)
    assert len(pipeline.stack_stages(specs, 2).layers) == 2  # stage positions: dense, MoE
    with pytest.raises(
        ValueError, match=r"pipeline=4 would stack layers of different kinds.*\[1, 2\]"
    ):
        pipeline.stack_stages(specs, 4)


@pytest.mark.parametrize("mesh_spec", ["pipeline=4", "pipeline=2,tensor=2"])
@pytest.mark.parametrize("source", ["host", "device"])
def test_place_stacked_layers_each_layer_on_its_stage_only(mesh_spec, source):
    cfg = _cfg(8)
    mesh = _mesh(mesh_spec)
    num_stages = mesh.shape["pipeline"]
    specs = llama.param_specs(cfg)
    stacked_specs = pipeline.stack_stages(specs, num_stages)
    params = jax.tree.map(np.asarray, init_random(specs, jax.random.key(1)))
    layers = params.layers if source == "host" else jax.device_put(params.layers, jax.devices()[0])
    rules = _rules(cfg, mesh)
    placed = pipeline.place_stacked_layers(layers, stacked_specs, mesh, rules=rules)
    lps = 8 // num_stages
    stage_devices = [set(mesh.devices[0, s].flat) for s in range(num_stages)]
    for j, layer in enumerate(placed):
        leaves = jax.tree.leaves(layer)
        spec_leaves = jax.tree.leaves(stacked_specs.layers[j], is_leaf=is_spec)
        for arr, spec in zip(leaves, spec_leaves):
            assert arr.sharding.spec == shd.logical_to_spec(spec.logical_axes, rules)
            for shard in arr.addressable_shards:
                s = shard.index[0].start
                assert shard.data.shape[0] == 1 and shard.device in stage_devices[s]
        for s in range(num_stages):
            ref = params.layers[s * lps + j]
            for arr, want in zip(leaves, jax.tree.leaves(ref)):
                np.testing.assert_array_equal(np.asarray(arr[s]), want)
    # per-device bytes of the layer weights = total / (pipeline * tensor) for split leaves
    total = sum(x.nbytes for x in jax.tree.leaves(params.layers))
    dev0 = jax.devices()[0]
    local = sum(
        sh.data.nbytes
        for x in jax.tree.leaves(placed)
        for sh in x.addressable_shards
        if sh.device == dev0
    )
    assert total / num_stages / mesh.shape["tensor"] <= local <= total / num_stages * 1.05


def test_stage_kv_caches_live_on_their_stage():
    mesh = _mesh("pipeline=4")
    caches = pipeline.stage_kv_caches(8, 4, (16, 4, 4, 16), jnp.float32, mesh)
    assert len(caches) == 2
    for c in caches:
        assert c.shape == (4, 16, 4, 4, 16)
        for shard in c.addressable_shards:
            assert shard.data.shape[0] == 1
            assert shard.device == mesh.devices[0, shard.index[0].start, 0, 0]
    canon = [jnp.full((2, 3), i, jnp.float32) for i in range(8)]
    stacked = pipeline.stack_kv_caches(canon, 4)
    assert float(stacked[1][2, 0, 0]) == 5.0
    assert [float(c[0, 0]) for c in pipeline.unstack_kv_caches(stacked)] == list(range(8))


def test_stage_windows_must_agree_across_stages():
    assert pipeline.stage_windows([8, None, 8, None], 2) == (8, None)
    with pytest.raises(ValueError, match=r"pipeline=4 .*use pipeline in \[1, 2\]"):
        pipeline.stage_windows([8, None, 8, None], 4)


def _moe_cfg(num_layers=4):
    from tests.model_utils import hf_config_dict

    # NOTE: 4 KV heads so they split over the 4 attention shards of tensor=2,expert=2 (MoE models
    # split attention over expert x tensor) and the caches compare head for head.
    return ModelConfig.from_hf(
        {**hf_config_dict("mixtral"), "num_hidden_layers": num_layers, "num_key_value_heads": 4}
    )


@pytest.mark.parametrize(
    "mesh_spec,moe",
    [
        ("pipeline=4", False),
        ("pipeline=2", False),
        ("pipeline=2,tensor=2", False),
        ("tensor=2,pipeline=2,expert=2", True),
        ("tensor=2,pipeline=2,expert=2", False),
    ],
)
def test_pipelined_forward_matches_single_device(mesh_spec, moe):
    """llama.forward on a pipeline mesh: two micro-batches of two sequences each; prefill then
    two decode steps; logits and every layer's KV cache == single device (dense 8 layers; a
    4-layer Mixtral with 8 experts, and the dense model, on the 3-axis mesh)."""
    from jaxinfer.step import StepInputs, build_step_arrays

    # NOTE: on expert x tensor = 4 attention shards a dense model needs 4 KV heads too, so the
    # caches compare head for head (the dense model's expert axis is more tensor parallelism).
    dense = _cfg(8, kv_heads=4 if "expert" in mesh_spec else 2)
    cfg, page, num_pages = (_moe_cfg(4) if moe else dense), 4, 32
    num_layers = cfg.num_layers
    mesh = _mesh(mesh_spec)
    num_stages = mesh.shape["pipeline"]
    specs = llama.param_specs(cfg)
    params = init_random(specs, jax.random.key(2))
    params = jax.tree.map(lambda x: x * 5 if x.ndim >= 2 else x, params)  # logits far from flat
    placed = pipeline.to_stacked(params, specs, mesh, rules=_rules(cfg, mesh))
    shape = (num_pages, page, 2 * cfg.num_kv_heads, cfg.head_dim)
    inner = llama.kv_cache_spec(cfg, shd.Parallel.from_mesh(mesh))
    caches = pipeline.stage_kv_caches(
        num_layers, num_stages, shape, jnp.float32, mesh, inner_spec=inner, fill=float("nan")
    )
    ref_caches = tuple(jnp.full(shape, jnp.nan) for _ in range(num_layers))

    def run(params, caches, step):
        return llama.forward_jit(params, cfg, step, caches, mesh=mesh)

    rng = np.random.default_rng(0)
    lens = [7, 3, 5, 9]  # sequences 0,1 in micro-batch 0; 2,3 in micro-batch 1
    toks = [list(rng.integers(0, 256, n)) for n in lens]
    pages = [[1 + 4 * i + k for k in range(4)] for i in range(4)]
    done = [0] * 4
    for new in (lens, [1, 1, 1, 1], [1, 1, 1, 1]):
        seqs = []
        for i, n in enumerate(new):
            if done[i] + n > len(toks[i]):
                toks[i].append(int(rng.integers(0, 256)))
            seqs.append((toks[i][done[i] : done[i] + n], done[i], pages[i]))
        mbs = [
            build_step_arrays(
                seqs[2 * m : 2 * m + 2], page, num_tokens=16, num_seqs=2, pages_per_seq=4
            )
            for m in range(2)
        ]
        stacked = StepInputs(**{k: jnp.asarray(np.stack([mb[k] for mb in mbs])) for k in mbs[0]})
        logits, caches = run(placed, caches, stacked)
        logits = np.asarray(logits).reshape(2, -1, cfg.vocab_size)
        for m in range(2):
            ref, ref_caches = llama.forward_jit(params, cfg, StepInputs(**mbs[m]), ref_caches)
            ref = np.asarray(ref)
            err = np.max(np.abs(np.asarray(logits[m]) - ref)) / np.max(np.abs(ref))
            assert err <= 1e-4, (m, err)
        done = [d + n for d, n in zip(done, new)]
    for got, want in zip(pipeline.unstack_kv_caches(caches), ref_caches):
        np.testing.assert_allclose(
            np.asarray(got)[1:17], np.asarray(want)[1:17], rtol=1e-5, atol=1e-5
        )
    for c in caches:
        assert c.sharding.spec[0] == "pipeline"
        for shard in c.addressable_shards:  # each layer's cache on its own stage only
            assert shard.data.shape[0] == 1
            assert shard.device in set(pipeline.stage_mesh(mesh, shard.index[0].start).devices.flat)


@pytest.mark.parametrize("mesh_spec", ["pipeline=4", "pipeline=2,tensor=2"])
def test_orbax_restore_onto_stages_then_stacked(tmp_path, mesh_spec):
    """Convert once (canonical layout), restore on a pipeline mesh: each layer lands on its stage."""
    from checkpoints.orbax_io import restore_params, save_params

    cfg = _cfg(8)
    mesh = _mesh(mesh_spec)
    num_stages = mesh.shape["pipeline"]
    specs = llama.param_specs(cfg)
    params = jax.tree.map(np.asarray, init_random(specs, jax.random.key(3)))
    save_params(tmp_path / "ckpt", params)
    rules = _rules(cfg, mesh)
    restored = restore_params(tmp_path / "ckpt", pipeline.canonical_targets(specs, mesh, rules))
    lps = 8 // num_stages
    for i, layer in enumerate(restored.layers):
        stage_devs = set(pipeline.stage_mesh(mesh, i // lps).devices.flat)
        for x in jax.tree.leaves(layer):
            assert set(x.sharding.device_set) == stage_devs
    stacked = pipeline.to_stacked(restored, specs, mesh, delete_sources=True, rules=rules)
    assert all(x.is_deleted() for x in jax.tree.leaves(restored.layers))
    assert stacked.embed.sharding.spec == P("tensor", None)
    o = stacked.layers[1].attn.o
    assert o.sharding.spec == P("pipeline", "tensor", None)
    for s in range(num_stages):
        np.testing.assert_array_equal(np.asarray(o[s]), params.layers[s * lps + 1].attn.o)
    np.testing.assert_array_equal(
        np.asarray(pipeline.unstack_stages(jax.tree.map(np.asarray, stacked)).layers[5].mlp.down),
        params.layers[5].mlp.down,
    )


def test_load_model_on_pipeline_mesh_hf_and_orbax(tmp_path):
    """HF dir and its orbax conversion both load stacked by stage; unstacked == the weights."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from jaxinfer.convert import convert
    from jaxinfer.loader import load_model
    from tests.model_utils import hf_config_dict, make_hf_model, params_from_torch
    from tests.test_convert import _write_tokenizer

    model, _ = make_hf_model("llama")  # 2 layers
    src = tmp_path / "hf"
    model.save_pretrained(str(src), safe_serialization=True)
    _write_tokenizer(src)
    convert(src, tmp_path / "orbax", dtype="float32")
    want = jax.tree.map(
        np.asarray, params_from_torch(model, ModelConfig.from_hf(hf_config_dict("llama")))
    )
    mesh = _mesh("pipeline=2,tensor=2")
    for path in (src, tmp_path / "orbax"):
        got = load_model(path, dtype="float32", mesh=mesh).params
        assert len(got.layers) == 1 and got.layers[0].attn.qkv.shape[0] == 2
        assert got.layers[0].mlp.down.sharding.spec == P("pipeline", "tensor", None)
        for shard in got.layers[0].mlp.down.addressable_shards:
            assert shard.device in set(pipeline.stage_mesh(mesh, shard.index[0].start).devices.flat)
        back = pipeline.unstack_stages(jax.tree.map(np.asarray, got))
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)


def test_compiled_pipeline_forward_collectives():
    """pipeline=4, M=4: one activation hand-off [T, E] per tick boundary (M + S - 2 of them) and
    one all-reduce of the last stage's [M, N, E] logits rows; no other collective."""
    import re

    from jaxinfer.step import StepInputs, build_step_arrays

    cfg, num_stages, num_mb, t = _cfg(8), 4, 4, 8
    mesh = _mesh("pipeline=4")
    specs = llama.param_specs(cfg)
    placed = pipeline.to_stacked(
        init_random(specs, jax.random.key(0)), specs, mesh, rules=_rules(cfg, mesh)
    )
    caches = pipeline.stage_kv_caches(
        8, num_stages, (16, 4, 4, 16), jnp.float32, mesh, inner_spec=P("data", None, "tensor", None)
    )
    mbs = [
        build_step_arrays([([1, 2, 3], 0, [1])], 4, num_tokens=t, num_seqs=2, pages_per_seq=2)
        for _ in range(num_mb)
    ]
    step = StepInputs(**{k: jnp.asarray(np.stack([m[k] for m in mbs])) for k in mbs[0]})
    hlo = llama.forward_jit.lower(placed, cfg, step, caches, mesh=mesh).compile().as_text()

    def ops(name):
        return re.findall(r"= (\S+) " + name + r"(?:-start)?\(", hlo)

    assert ops("collective-permute") == [f"f32[{t},64]{{1,0}}"] * (num_mb + num_stages - 2)
    assert ops("all-reduce") == ["f32[4,1,64]{2,1,0}"]
    assert ops("all-gather") == [] and ops("all-to-all") == []


def _tiny_loaded(tok, num_layers: int):
    import dataclasses

    from jaxinfer.model_info import LoadedModel
    from tests.engine_utils import LM_HEAD_SCALE, MATRIX_SCALE, TINY_LLAMA

    hf = {**TINY_LLAMA, "vocab_size": tok.vocab_size, "num_hidden_layers": num_layers}
    cfg = ModelConfig.from_hf(hf)
    params = init_random(llama.param_specs(cfg), jax.random.key(0))
    params = jax.tree.map(lambda x: x * MATRIX_SCALE if x.ndim > 1 else x, params)
    params = dataclasses.replace(params, lm_head=params.lm_head * LM_HEAD_SCALE)
    return LoadedModel("tiny", "<memory>", "random", cfg, hf, params, tok, "float32")


def _pipeline_engine(model, mesh: str):
    from jaxinfer.config import EngineConfig
    from jaxinfer.engine.engine import LLMEngine

    # NOTE: every step (prefill chunks and decodes of up to 4 sequences) pads to one 16-token
    # bucket: one program per mesh instead of one per power of two (each a pipelined program over
    # 8 devices, whose compile costs far more than the padded decode tokens).
    return LLMEngine(
        model,
        EngineConfig(
            page_size=4,
            num_pages=40,
            max_model_len=64,
            max_num_seqs=4,
            max_num_batched_tokens=16,
            token_buckets=(16,),
            mesh=mesh,
        ),
    )


@pytest.fixture(scope="module")
def single_device_run():
    """The 4-layer model, the requests, and their single-device results (one reference engine for
    every mesh below)."""
    from tests.engine_utils import greedy, load_vocab, run

    model = _tiny_loaded(load_vocab(), num_layers=4)
    rng = np.random.default_rng(0)
    reqs = [
        (f"r{i}", rng.integers(100, 40000, n).tolist(), greedy(8, logprobs=2))
        for i, n in enumerate([5, 9, 3, 12, 7])
    ]
    return model, reqs, run(_pipeline_engine(model, ""), reqs)


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["pipeline=4,tensor=2", "data=2,pipeline=2,tensor=2"])
def test_engine_greedy_tokens_on_pipeline_mesh_equal_single_device(spec, single_device_run):
    """The engine on a pipeline mesh (micro-batches of whole sequences, chunked prefill through a
    16-token budget) generates the single-device greedy tokens, logprobs within 1e-4; the runner's
    layer weights and KV caches live on their stages only, per-device layer bytes = total / S / T."""
    from tests.engine_utils import assert_same_greedy, run

    model, reqs, ref = single_device_run
    eng = _pipeline_engine(model, spec)
    ours = run(eng, reqs)
    assert_same_greedy(ours, ref, [rid for rid, *_ in reqs])

    runner, mesh = eng.runner, eng.mesh
    num_stages, tensor = mesh.shape["pipeline"], mesh.shape["tensor"]
    assert len(runner.params.layers) == 4 // num_stages
    for x in jax.tree.leaves(runner.params.layers) + list(runner.kv_caches):
        assert x.sharding.spec[0] == "pipeline"
        for shard in x.addressable_shards:
            assert shard.device in set(pipeline.stage_mesh(mesh, shard.index[0].start).devices.flat)
    dev = mesh.devices.flat[0]
    total = sum(x.nbytes for x in jax.tree.leaves(runner.params.layers))
    split = sum(
        x.nbytes for x in jax.tree.leaves(runner.params.layers) if "tensor" in x.sharding.spec
    )
    local = sum(
        s.data.nbytes
        for x in jax.tree.leaves(runner.params.layers)
        for s in x.addressable_shards
        if s.device == dev
    )
    assert local == (total - split) / num_stages + split / num_stages / tensor
    assert local <= 1.05 * total / num_stages / tensor + (total - split) / num_stages


def test_place_params_accepts_canonical_or_stacked_and_names_a_mismatch():
    cfg = _cfg(4)
    mesh = _mesh("pipeline=2,tensor=2")
    specs = llama.param_specs(cfg)
    params = init_random(specs, jax.random.key(4))
    rules = _rules(cfg, mesh)
    stacked = pipeline.place_params(params, specs, mesh, rules)
    again = pipeline.place_params(
        stacked, specs, mesh, rules
    )  # the loader's output: already placed
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(stacked), strict=True):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="params hold 3 layers"):
        pipeline.place_params(params.replace(layers=params.layers[:3]), specs, mesh, rules)


def test_pipeline_runner_programs_update_kv_cache_in_place():
    """No compiled pipeline step copies a KV cache (the donated caches are written in place by
    every tick), including decode buckets where a micro-batch holds a single token."""
    import re

    from jaxinfer.engine.runner import ModelRunner
    from tests.model_utils import hf_config_dict

    cfg = ModelConfig.from_hf({**hf_config_dict("llama"), "num_hidden_layers": 2})
    runner = ModelRunner(
        cfg,
        init_random(llama.param_specs(cfg), jax.random.key(0)),
        page_size=16,
        num_pages=1024,
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=4,
        mesh=_mesh("pipeline=2"),
    )
    assert runner.token_buckets == (2, 4)
    for t_bucket, all_logits in [(2, False), (4, False), (2, True)]:
        hlo = runner.lower(t_bucket, all_logits).compile().as_text()
        copies = [
            line for line in hlo.splitlines() if re.search(r" copy\(", line) and "1024,16," in line
        ]
        assert not copies, (t_bucket, all_logits, copies[:2])
