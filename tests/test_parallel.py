"""Tensor and data parallelism on 8 virtual CPU devices: sharded == single device.

1. `forward` on a mesh (one shard_map, manual SPMD) gives the single-device logits (f32, within
   1e-4 of the logit scale) on `tensor=8`, `data=2,tensor=4` and `tensor=4` with 2 KV heads
   (replicated KV), through prefill and paged decode.
2. The engine on those meshes generates the single-device greedy tokens (identical) with the
   same logprobs; with `data=2` requests are spread over both replicas' page pools.
3. Each parameter's actual sharding matches a golden table per mesh; per-device parameter bytes
   are total / shard count.
4. The compiled TP decode program holds exactly two all-reduces of [tokens, hidden] per layer,
   plus the vocab-parallel embedding's one (counted separately).
5. Invalid meshes are rejected with a message that says what to change.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxinfer import params as params_lib
from jaxinfer import sharding as shd
from jaxinfer.config import EngineConfig, ModelConfig, parse_mesh
from jaxinfer.engine.engine import LLMEngine
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.model_info import LoadedModel
from jaxinfer.models import llama
from jaxinfer.step import StepInputs, build_step_arrays
from tests.engine_utils import assert_same_greedy, greedy, load_vocab, run
from tests.model_utils import rel_err
from tests.script_utils import script

PAGE_SIZE, NUM_PAGES = 4, 32


def tiny_cfg(
    num_kv_heads: int, vocab_size: int = 512, layers: int = 2, moe: bool = False
) -> ModelConfig:
    """A tiny Llama, or with `moe` a tiny Mixtral (8 experts, top-2) of the same shape."""
    experts = dict(num_local_experts=8, num_experts_per_tok=2) if moe else {}
    return ModelConfig.from_hf(
        dict(
            model_type="mixtral" if moe else "llama",
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=layers,
            num_attention_heads=8,
            num_key_value_heads=num_kv_heads,
            head_dim=8,
            max_position_embeddings=256,
            tie_word_embeddings=False,
            **experts,
        )
    )


def tiny_params(cfg: ModelConfig, seed: int = 0):
    """Random weights scaled so logits are far from flat (greedy decisions far from ties)."""
    params = params_lib.init_random(llama.param_specs(cfg), jax.random.key(seed))
    params = jax.tree.map(lambda x: x * 2 if x.ndim > 1 else x, params)
    return dataclasses.replace(params, lm_head=params.lm_head * 10)


def mesh_of(spec: str, num_devices: int = 8):
    return shd.make_mesh(spec, devices=jax.devices()[:num_devices])


def place(cfg: ModelConfig, params, mesh):
    rules = shd.model_rules(cfg, shd.Parallel.from_mesh(mesh))
    return jax.device_put(params, params_lib.shardings(llama.param_specs(cfg), mesh, rules))


# (mesh, devices, KV heads): the meshes of the issue with a dense model.
# On a dense model `expert` is more tensor parallelism (sharding.dense_axes).
MESHES = [
    ("tensor=8", 8, 8),
    ("data=2,tensor=4", 8, 8),
    ("tensor=4", 4, 2),
    ("expert=4", 4, 8),
    ("data=2,expert=2,tensor=2", 8, 8),
]
# The MoE meshes (tiny Mixtral); more MoE mesh cases, the engine's tokens included, are in
# tests/test_moe.py.
MOE_MESHES = [("expert=4", 4, 8), ("tensor=2,expert=4", 8, 8), ("data=2,tensor=2,expert=2", 8, 8)]


def _steps(data: int):
    """Two ragged steps per replica: a prefill of two sequences, then a decode of both."""
    prefill = [
        [(list(range(7, 17)), 0, [3, 5, 7]), ([9, 8, 7], 0, [1])],
        [([40, 41, 42, 43, 44], 0, [2, 4]), (list(range(60, 66)), 0, [6, 8])],
    ]
    decode = [[([17], 10, [3, 5, 7]), ([6], 3, [1])], [([45], 5, [2, 4]), ([66], 6, [6, 8])]]
    for seqs in (prefill, decode):
        arrays = [
            build_step_arrays(seqs[r], PAGE_SIZE, num_tokens=16, num_seqs=4, pages_per_seq=4)
            for r in range(data)
        ]
        yield arrays


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec,num_devices,kv_heads,moe",
    [(*m, False) for m in MESHES] + [(*m, True) for m in MOE_MESHES],
)
def test_forward_on_mesh_equals_single_device(spec, num_devices, kv_heads, moe):
    cfg = tiny_cfg(kv_heads, moe=moe)
    params = tiny_params(cfg)
    mesh = mesh_of(spec, num_devices)
    par = shd.Parallel.from_mesh(mesh)
    sharded = place(cfg, params, mesh)
    cache_heads = shd.kv_cache_heads(cfg.num_kv_heads, par.dense)
    gshape = (par.data * NUM_PAGES, PAGE_SIZE, 2 * cache_heads, cfg.head_dim)
    sharding = NamedSharding(mesh, llama.kv_cache_spec(cfg, shd.Parallel.from_mesh(mesh)))
    caches = tuple(jax.device_put(jnp.zeros(gshape), sharding) for _ in range(cfg.num_layers))
    ref_caches = [
        tuple(
            jnp.zeros((NUM_PAGES, PAGE_SIZE, 2 * cfg.num_kv_heads, cfg.head_dim))
            for _ in range(cfg.num_layers)
        )
        for _ in range(par.data)
    ]
    for arrays in _steps(par.data):
        refs = []
        for r in range(par.data):  # each replica's step alone on one device
            step = StepInputs(**{k: jnp.asarray(v) for k, v in arrays[r].items()})
            ref, ref_caches[r] = llama.forward_jit(params, cfg, step, ref_caches[r])
            refs.append(np.asarray(ref))
        fields = (
            arrays[0] if par.data == 1 else {k: np.stack([a[k] for a in arrays]) for k in arrays[0]}
        )
        step = StepInputs(**{k: jnp.asarray(v) for k, v in fields.items()})
        logits, caches = llama.forward_jit(sharded, cfg, step, caches, mesh=mesh)
        if par.dense > 1:  # logits leave sharded on vocab (over expert x tensor on MoE models)
            want = NamedSharding(
                mesh, PartitionSpec(*logits.sharding.spec[:-1], shd.dense_axes(cfg, par))
            )
            assert logits.sharding.is_equivalent_to(want, logits.ndim)
        ours = np.asarray(logits).reshape(par.data, *refs[0].shape)
        for r in range(par.data):
            assert rel_err(ours[r], refs[r]) <= 1e-4, (spec, r, rel_err(ours[r], refs[r]))


@pytest.fixture(scope="module")
def vocab():
    return load_vocab()


def _model(tok, kv_heads: int) -> LoadedModel:
    cfg = tiny_cfg(kv_heads, vocab_size=tok.vocab_size)
    hf = {"num_key_value_heads": kv_heads}
    return LoadedModel("tiny", "<memory>", "random", cfg, hf, tiny_params(cfg), tok, "float32")


def _engine(model: LoadedModel, mesh: str) -> LLMEngine:
    # NOTE: a 32-token budget prefills the first four prompts in one step (the fifth joins the
    # decodes later), and every step pads to one 32-token bucket: one program per mesh instead of
    # one per power of two up to 32 (its compile costs far more than the padded decode tokens).
    return LLMEngine(
        model,
        EngineConfig(
            page_size=PAGE_SIZE,
            num_pages=40,
            max_model_len=64,
            max_num_seqs=4,
            max_num_batched_tokens=32,
            token_buckets=(32,),
            mesh=mesh,
        ),
    )


@pytest.fixture(scope="module")
def single_device_runs():
    """KV heads -> the single-device `run` results of `mesh_requests()` (one reference engine per
    model, shared by the meshes)."""
    return {}


def mesh_requests() -> list:
    rng = np.random.default_rng(0)
    return [
        (f"r{i}", rng.integers(100, 40000, n).tolist(), greedy(8, logprobs=2))
        for i, n in enumerate([5, 9, 3, 12, 7])
    ]


@pytest.mark.slow
# Suite time: data=2,tensor=4 runs with 2 KV heads only (replicas and replicated KV together);
# KV split by heads is the tensor=8 case.
@pytest.mark.parametrize(
    "spec,kv_heads", [("tensor=8", 8), ("data=2,tensor=4", 2), ("expert=4,tensor=2", 8)]
)
def test_engine_greedy_tokens_on_mesh_equal_single_device(
    vocab, single_device_runs, spec, kv_heads
):
    model = _model(vocab, kv_heads)  # NOTE: seeded: the same weights for every mesh
    reqs = mesh_requests()
    if kv_heads not in single_device_runs:
        single_device_runs[kv_heads] = run(_engine(model, ""), reqs)
    ref = single_device_runs[kv_heads]
    engine = _engine(model, spec)
    replicas = set()
    original = engine.scheduler.schedule

    def schedule():
        out = original()
        replicas.update(s.replica for s in out.scheduled)
        return out

    engine.scheduler.schedule = schedule
    ours = run(engine, reqs)
    assert_same_greedy(ours, ref, [rid for rid, *_ in reqs])
    assert replicas == set(range(engine.mesh.shape[shd.DATA]))
    for alloc in engine.allocators:
        alloc.check_invariants()
        assert alloc.num_free_pages == alloc.num_usable_pages
    # each program compiled once: a step leaves what it carries (KV cache, penalty state, fed-back
    # ids) laid out as it came in, so the second call of a bucket does not recompile it
    runner = engine.core.runner
    assert runner.compiled_program_count() == runner.num_compiled


def _spec(x) -> tuple:
    spec = tuple(x.sharding.spec)
    while spec and spec[-1] is None:
        spec = spec[:-1]
    return spec


T = shd.TENSOR
ET = (shd.EXPERT, shd.TENSOR)  # MoE models: dense weights split over expert x tensor
GOLDEN = {  # (mesh, KV heads, moe) -> leaf -> mesh axes per dim (trailing replicated dims dropped)
    ("tensor=8", 8, False): {
        "embed": (T,),
        "lm_head": (None, T),
        "final_norm": (),
        "attn_norm": (),
        "qkv": (None, T),
        "o": (T,),
        "gate_up": (None, None, T),
        "down": (T,),
    },
    # 2 KV heads over tensor=4: the fused QKV projection replicated (a shard's query heads are
    # part of a KV group), each shard slices its heads out of the product.
    ("data=2,tensor=4", 2, False): {
        "embed": (T,),
        "lm_head": (None, T),
        "final_norm": (),
        "attn_norm": (),
        "qkv": (),
        "o": (T,),
        "gate_up": (None, None, T),
        "down": (T,),
    },
    # MoE: attention, embedding and LM head over expert x tensor; experts on expert, their F on
    # tensor; only norms and the router replicated.
    ("expert=4,tensor=2", 8, True): {
        "embed": (ET,),
        "lm_head": (None, ET),
        "final_norm": (),
        "attn_norm": (),
        "qkv": (None, ET),
        "o": (ET,),
        "router": (),
        "gate_up": ("expert", None, None, T),
        "down": ("expert", T),
    },
    ("expert=8", 8, True): {
        "embed": (ET,),
        "lm_head": (None, ET),
        "final_norm": (),
        "attn_norm": (),
        "qkv": (None, ET),
        "o": (ET,),
        "router": (),
        "gate_up": ("expert", None, None, T),
        "down": ("expert", T),
    },
    # 2 KV heads over expert x tensor = 4: the QKV projection replicated, like tensor=4 above.
    ("expert=2,tensor=2", 2, True): {
        "embed": (ET,),
        "lm_head": (None, ET),
        "final_norm": (),
        "attn_norm": (),
        "qkv": (),
        "o": (ET,),
        "router": (),
        "gate_up": ("expert", None, None, T),
        "down": ("expert", T),
    },
}


@pytest.mark.parametrize("spec,kv_heads,moe", list(GOLDEN))
def test_param_shardings_match_golden_table_and_bytes_split(spec, kv_heads, moe):
    cfg = tiny_cfg(kv_heads, layers=2, moe=moe)
    mesh = mesh_of(spec, math.prod(parse_mesh(spec).values()))
    p = place(cfg, tiny_params(cfg), mesh)
    layer = p.layers[1]
    actual = {
        "embed": p.embed,
        "lm_head": p.lm_head,
        "final_norm": p.final_norm,
        "attn_norm": layer.attn_norm,
        "qkv": layer.attn.qkv,
        "o": layer.attn.o,
        "gate_up": layer.mlp.gate_up,
        "down": layer.mlp.down,
    }
    if moe:
        actual["router"] = layer.mlp.router
    assert {k: _spec(v) for k, v in actual.items()} == GOLDEN[(spec, kv_heads, moe)]
    dev = mesh.devices.flat[0]
    per_device = sum(
        s.data.nbytes for x in jax.tree.leaves(p) for s in x.addressable_shards if s.device == dev
    )
    total = params_lib.num_bytes(p)
    shards = mesh.size  # every split leaf here is split over all non-data axes
    shards //= mesh.shape[shd.DATA]
    replicated = sum(x.nbytes for x in jax.tree.leaves(p) if not _spec(x))
    assert per_device == pytest.approx((total - replicated) / shards + replicated, rel=1e-6)
    if shd.kv_heads_split(kv_heads, shards):  # only norms (and routers) replicated: the 5% bar
        assert per_device <= 1.05 * total / shards


def test_tp_decode_program_has_two_hidden_all_reduces_per_layer():
    cfg = tiny_cfg(8, layers=3)
    runner = ModelRunner(
        cfg,
        tiny_params(cfg),
        page_size=PAGE_SIZE,
        num_pages=NUM_PAGES,
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=8,
        mesh=mesh_of("tensor=8"),
    )
    t_bucket = 4  # a decode of 4 sequences
    hlo = runner.lower(t_bucket).compile().as_text()
    hidden = [
        line
        for line in hlo.splitlines()
        if re.search(
            rf"= f32\[{t_bucket},{cfg.hidden_size}\]\{{[0-9,]*\}} all-reduce(-start)?\(", line
        )
    ]
    scopes = [re.search(r'op_name="([^"]*)"', line).group(1) for line in hidden]
    in_layers = [s for s in scopes if "/layer_" in s]
    embedding = [s for s in scopes if "/embed/" in s]
    assert len(in_layers) == 2 * cfg.num_layers, scopes
    for i in range(cfg.num_layers):
        assert sorted(s.split(f"layer_{i}/")[1] for s in in_layers if f"/layer_{i}/" in s) == [
            "attention/o_proj/psum",
            "mlp/psum",
        ]
    assert len(embedding) == 1 and len(scopes) == 2 * cfg.num_layers + 1, scopes


@pytest.mark.parametrize(
    "spec,kw,message",
    [
        ("tensor=3", {}, "spans 3 devices but 8"),
        ("tensor=16", {"num_devices": 16}, "num_heads=8 is not divisible by tensor=16"),
        ("tenser=8", {}, "unknown mesh axis 'tenser'"),
        ("tensor=x", {}, "needs an integer size"),
        ("pipeline=8", {}, "num_layers=2 is not divisible by pipeline=8"),
        (
            "expert=4,tensor=4",
            {"num_devices": 16},
            "num_heads=8 is not divisible by expert*tensor=16",
        ),
        (
            "expert=2,tensor=8",
            {"moe": True, "num_devices": 16},
            "num_heads=8 is not divisible by expert*tensor=16",
        ),
        ("data=8", {"max_num_seqs": 4}, "max_num_seqs=4 is not divisible by data=8"),
        ("data=8", {"max_num_seqs": 8, "num_pages": 12}, "num_pages=12 does not split into data=8"),
    ],
)
def test_invalid_meshes_are_rejected_saying_what_to_change(spec, kw, message):
    kw = {"num_devices": 8, **kw}
    cfg = tiny_cfg(2, moe=kw.pop("moe", False))
    with pytest.raises(ValueError, match=re.escape(message)):
        shd.check_mesh(cfg, spec, **kw)


def test_vocab_intermediate_and_kv_heads_that_do_not_split_are_rejected():
    cfg = ModelConfig.from_hf(
        dict(
            model_type="llama",
            vocab_size=500,
            hidden_size=64,
            intermediate_size=100,
            num_hidden_layers=2,
            num_attention_heads=24,
            num_key_value_heads=3,
            head_dim=8,
            max_position_embeddings=256,
        )
    )
    with pytest.raises(ValueError) as e:
        shd.check_mesh(cfg, "tensor=8", num_devices=8)
    msg = str(e.value)
    for part in (
        "vocab_size=500 is not divisible by tensor=8",
        "intermediate_size=100 is not divisible by tensor=8",
        "num_kv_heads=3 and tensor=8: one must divide the other",
    ):
        assert part in msg, msg


def test_engine_rejects_a_mesh_the_devices_do_not_match(vocab):
    with pytest.raises(ValueError, match="make the product of the axis sizes equal 8"):
        _engine(_model(vocab, 2), "tensor=4")
    with pytest.raises(ValueError, match="unknown mesh axis 'model'"):
        EngineConfig(mesh="model=8")


def _save_hf_dir(root):
    """A tiny random Llama HF dir (8 heads, 8 KV heads) with a word-level tokenizer.json."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=8,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.0 if p.ndim == 1 else 7.0)  # std 0.02 -> 0.14: logits far from ties
    model.save_pretrained(str(root), safe_serialization=True)
    words = {f"t{i}": i for i in range(256)}
    tok = Tokenizer(models.WordLevel(words, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text('{"eos_token": "t2"}')
    return root


@pytest.mark.slow
def test_llm_and_serve_load_a_checkpoint_onto_the_mesh(tmp_path):
    """`LLM(path, mesh=...)` and `serve.py --mesh` place the weights sharded and give the
    single-device tokens."""
    from jaxinfer.llm import LLM
    from jaxinfer.sampling_params import SamplingParams

    serve = script("serve")

    path = str(_save_hf_dir(tmp_path))
    options = dict(
        page_size=4,
        num_pages=32,
        max_model_len=32,
        max_num_seqs=2,
        max_num_batched_tokens=8,
        token_buckets=(2, 8),  # both prompts prefill in one 8-token step; decodes pad to 2
    )
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [20, 21, 22]]
    ref = [o.token_ids for o in LLM(path, **options).generate(prompts, sp)]
    llm = LLM(path, mesh="data=2,tensor=4", **options)
    assert _spec(llm.model.params.layers[0].attn.o) == (T,)
    assert [o.token_ids for o in llm.generate(prompts, sp)] == ref

    args = serve.build_parser().parse_args(
        [
            "--model",
            path,
            "--mesh",
            "tensor=8",
            "--page-size",
            "4",
            "--num-pages",
            "32",
            "--max-model-len",
            "32",
            "--max-num-seqs",
            "2",
            "--max-num-batched-tokens",
            "8",
        ]
    )
    from serving.launch import build_core

    core = build_core(serve.engine_args(args))  # what the engine-core process builds
    assert core.mesh.shape[T] == 8 and core.info().mesh_shape[T] == 8
    assert _spec(core.runner.params.embed) == (T,)


def test_data_parallel_scheduler_spreads_requests_and_keeps_pages_per_replica():
    """Pure host policy (no JAX): least-loaded admission, per-replica budgets and pages, prefix
    hits only inside the replica that cached the pages."""
    from jaxinfer.engine.page_allocator import PageAllocator
    from jaxinfer.engine.request import Request
    from jaxinfer.engine.scheduler import Scheduler
    from jaxinfer.engine.types import RunnerOutput
    from jaxinfer.sampling_params import SamplingParams

    allocs = [PageAllocator(9, 4) for _ in range(2)]  # 8 usable pages per replica
    sched = Scheduler(allocs, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    shared = list(range(100, 108))  # two full pages
    for i, prompt in enumerate([shared + [1], [7] * 6, [8] * 5, [9] * 3, [5] * 2]):
        sched.add_request(Request(f"r{i}", prompt, sp, arrival_time=float(i)))

    out = sched.schedule()
    by_replica = {r: [s for s in out.scheduled if s.replica == r] for r in (0, 1)}
    # 2 sequences per replica at most (max_num_seqs / data), each within its own token budget.
    assert [len(v) for v in by_replica.values()] == [2, 2]
    assert all(sum(len(s.token_ids) for s in v) <= 16 for v in by_replica.values())
    assert sched.num_waiting == 1
    # Fewest running first, then most free pages: r2 goes where r1's 2 pages left more room.
    assert {s.request.request_id: s.replica for s in out.scheduled} == {
        "r0": 0,
        "r1": 1,
        "r2": 1,
        "r3": 0,
    }
    for s in out.scheduled:  # page ids come from the request's own replica pool
        assert s.is_new and list(s.new_page_ids) == s.request.page_ids
        assert all(allocs[s.replica].refcount(p) > 0 for p in s.new_page_ids)

    for _ in range(20):  # run to completion
        if not sched.has_unfinished():
            break
        sched.update(
            out, RunnerOutput({s.request.request_id: 3 for s in out.scheduled if s.sample})
        )
        out = sched.schedule()
    assert not sched.has_unfinished()
    for a in allocs:
        a.check_invariants()
    # The shared prefix (r0's first two pages) is cached in replica 0 only.
    cached_in = 0
    sched.add_request(Request("a", shared + [2], sp, arrival_time=50.0))
    sched.add_request(Request("b", shared + [3], sp, arrival_time=51.0))
    out = sched.schedule()
    hits = {s.request.request_id: (s.replica, s.start_pos) for s in out.scheduled}
    assert {r for r, _ in hits.values()} == {0, 1}
    for r, start in hits.values():
        assert start == (8 if r == cached_in else 0)
