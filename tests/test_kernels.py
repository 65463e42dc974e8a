"""Ragged paged attention kernels: the compiled CPU kernel (C++ through the XLA FFI, on a CPU
platform) and GPU/Triton and TPU/Mosaic (in Pallas interpret mode on CPU).

1. Every kernel (compiled instead where its hardware is present) against the reference:
   decode-only, prefill-only, mixed, ragged-edge and empty batches in one padded shape family (so
   they share compiled programs), sliding window (and the pages before it skipped), soft-cap,
   sinks, GQA ratios 1/2/3/4/8, head_dim 64/128, f32 and bf16, the block-size table's defaults; a
   random sweep is marked slow. Unused pages, unused slots of used pages and pages that padded
   page-table entries point at are NaN-filled. Tolerances live in `TOL` (keyed by platform and
   dtype; the reference runs at `highest` matmul precision). GPU split-K decode: split + combine,
   uneven and (per row) fully masked splits. Cases a platform cannot run are skipped: a kernel runs
   compiled on its own platform and interpreted only on a CPU platform.
2. The TPU kernel under `pltpu.InterpretParams(detect_races=True)`: no races reported (and the
   detector is shown to catch a deliberately racy kernel, so the check means something).
3. Both kernels lower for their real platform (Triton IR / Mosaic) without hardware (Triton: for
   an abstract H100 device, the API JAX 0.11 requires and 0.10 accepts).
4. The KV-cache write is checked bit for bit; invalid inputs raise (trace-time shapes and dtypes,
   host-side `check_values`); the dispatch in `jaxinfer.attention`.
5. End to end: the same greedy tokens from a tiny random model with every backend
   (`llama.forward(..., attention_backend=...)`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxinfer import attention as attn
from jaxinfer.config import ModelConfig
from jaxinfer.models import llama
from jaxinfer.params import init_random
from jaxinfer.step import StepInputs
from pallas_kernels.paged_common import interpret_mode
from pallas_kernels.ragged_paged_attention import KERNELS, block_sizes, reference, tpu_layout
from tests.model_utils import PagedStepper, hf_config_dict

# (platform, dtype) -> bound on both ||out - ref|| / ||ref|| and max|out - ref| / max|ref|, the
# reference computed at `highest` matmul precision. The kernels' own f32 dots run at the platform's
# default precision: exact on CPU, TF32 (10-bit mantissa) on GPU, bf16 passes on TPU.
TOL = {
    ("cpu", jnp.dtype(jnp.float32)): 1e-5,
    ("cpu", jnp.dtype(jnp.bfloat16)): 1e-2,
    ("gpu", jnp.dtype(jnp.float32)): 5e-3,
    ("gpu", jnp.dtype(jnp.bfloat16)): 1e-2,
    ("tpu", jnp.dtype(jnp.float32)): 1e-2,
    ("tpu", jnp.dtype(jnp.bfloat16)): 2e-2,
}


def tol(dtype) -> float:
    return TOL[(jax.default_backend(), jnp.dtype(dtype))]


def run_reference(*args, **kw) -> jax.Array:
    """The oracle at `highest` matmul precision (XLA:GPU would otherwise multiply f32 in TF32)."""
    with jax.default_matmul_precision("highest"):
        return reference.ragged_paged_attention(*args, **kw)


def runnable(backend: str) -> bool:
    """A kernel runs compiled on its own platform, and interpreted on a CPU platform; the compiled
    CPU kernel runs only on a CPU platform (it is built there on first use)."""
    return jax.default_backend() in ("cpu", backend)


def _kernel_param(backend: str):
    return pytest.param(
        backend,
        marks=pytest.mark.skipif(
            not runnable(backend),
            reason=f"the {backend} kernel runs on a {backend} or (interpreted) a CPU platform",
        ),
    )


KERNEL_BACKENDS = ("cpu", "gpu", "tpu")
BACKEND_PARAMS = [_kernel_param(b) for b in KERNEL_BACKENDS]
RUNNABLE = tuple(b for b in KERNEL_BACKENDS if runnable(b))
# Small blocks so the small test shapes still span several query blocks and KV blocks; the GPU
# kernel's decode class splits its KV range (split-K) over up to 16 programs (8 per KV head of BASE).
SMALL_BLOCKS = block_sizes.KernelBlocks(
    block_q=2, decode_block_q=1, pages_per_block=2, decode_programs=16
)


def _blocks(blocks, interpret):
    """Compiled, the kernels need hardware-sized blocks (Triton: >= 16 rows and keys): the table's."""
    return blocks if interpret is not False else None


@dataclasses.dataclass(frozen=True)
class Shape:
    """A padded shape family: every batch built with it compiles to the same programs."""

    num_q_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    page_size: int = 4
    pages_per_seq: int = 8
    num_pages: int = 48
    num_tokens: int = 16
    max_seqs: int = 4


def make_batch(shape: Shape, q_lens, kv_lens, seed: int = 0, dtype=jnp.float32):
    """Random q and a NaN-poisoned paged cache; pages handed out in shuffled order.

    Padded page-table entries alternate between an in-range page that is all NaN and ids outside
    [0, num_pages): a kernel that reads either as data shows it.
    """
    rng = np.random.default_rng(seed)
    ps, hkv, d = shape.page_size, shape.num_kv_heads, shape.head_dim
    n = len(q_lens)
    cache = np.full((shape.num_pages, ps, 2 * hkv, d), np.nan, np.float32)
    free = list(rng.permutation(shape.num_pages - 1))  # the last page stays NaN: a pad target
    nan_page = shape.num_pages - 1
    table = np.zeros((shape.max_seqs, shape.pages_per_seq), np.int32)
    for col in range(shape.pages_per_seq):
        table[:, col] = nan_page if col % 2 else shape.num_pages + 3 + col
    for s, kv_len in enumerate(kv_lens):
        for p in range(-(-kv_len // ps)):
            table[s, p] = page = free.pop()
            fill = min(ps, kv_len - p * ps)
            cache[page, :fill] = rng.standard_normal((fill, 2 * hkv, d))
    t_real = sum(q_lens)
    assert t_real <= shape.num_tokens and n <= shape.max_seqs
    cu = np.full(shape.max_seqs + 1, t_real, np.int32)
    cu[0] = 0
    cu[1 : n + 1] = np.cumsum(q_lens)
    lens = np.zeros(shape.max_seqs, np.int32)
    lens[:n] = kv_lens
    q = rng.standard_normal((shape.num_tokens, shape.num_q_heads, d)).astype(np.float32)
    return (
        jnp.asarray(q, dtype),
        jnp.asarray(cache, dtype),
        jnp.asarray(lens),
        jnp.asarray(table),
        jnp.asarray(cu),
        jnp.asarray([n], jnp.int32),
    )


def in_layout(backend: str, args):
    """The batch with its reference-layout cache in `backend`'s layout (the TPU kernel's own)."""
    if backend != "tpu":
        return args
    return (args[0], tpu_layout.from_reference_cache(args[1]), *args[2:])


def assert_matches_reference(backend, args, *, blocks=SMALL_BLOCKS, interpret=None, **kw):
    kw.setdefault("sm_scale", 0.125)
    reference.check_values(*args)
    ref = np.asarray(run_reference(*args, **kw), np.float32)
    if interpret is None:
        interpret = interpret_mode(backend)
    out = KERNELS[backend](
        *in_layout(backend, args), interpret=interpret, blocks=_blocks(blocks, interpret), **kw
    )
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    out = np.asarray(out, np.float32)
    assert np.isfinite(ref).all() and np.isfinite(out).all()
    bound = tol(args[0].dtype)
    assert np.linalg.norm(out - ref) <= bound * np.linalg.norm(ref)
    assert np.max(np.abs(out - ref)) <= bound * np.max(np.abs(ref))
    t_real = int(args[4][int(args[5][0])])
    assert not out[t_real:].any(), "padding tokens must produce zeros"


BASE = Shape()
SCENARIOS = {  # name -> (q_lens, kv_lens): fits BASE (16 tokens, 4 sequences, 32 keys a sequence)
    "decode": ([1, 1, 1, 1], [5, 17, 1, 32]),
    "prefill": ([7, 5, 3], [7, 5, 3]),
    "chunked_prefill": ([6, 9], [26, 9]),
    "mixed": ([1, 1, 6, 5], [9, 32, 20, 5]),
    "ragged_edge": ([1, 0, 13], [4, 6, 30]),  # a sequence with no new tokens, 3 padding tokens
    "empty": ([], []),
}


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_batches_match_reference(backend, scenario):
    q_lens, kv_lens = SCENARIOS[scenario]
    assert_matches_reference(backend, make_batch(BASE, q_lens, kv_lens, seed=len(scenario)))


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_default_block_sizes(backend):
    assert_matches_reference(backend, make_batch(BASE, *SCENARIOS["mixed"], seed=3), blocks=None)


@pytest.mark.skipif(jax.default_backend() == "tpu", reason="GPU interpret cases run on CPU/GPU")
def test_gpu_kernel_without_split_k():
    """decode_programs=0: every decode walks its whole KV range in one program."""
    blocks = dataclasses.replace(SMALL_BLOCKS, decode_programs=0)
    assert_matches_reference(
        "gpu",
        make_batch(BASE, *SCENARIOS["mixed"], seed=4),
        blocks=blocks,
        interpret=True,
        sinks=jnp.linspace(-1.0, 2.0, BASE.num_q_heads),
    )


FEATURES = {
    "window": dict(sliding_window=5),
    "softcap_sinks": dict(soft_cap=2.0, sinks=jnp.linspace(-1.0, 2.0, BASE.num_q_heads)),
    "window_softcap_sinks": dict(
        sliding_window=3, soft_cap=2.0, sinks=jnp.linspace(0.5, -3.0, BASE.num_q_heads)
    ),
}


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_features_match_reference(backend, feature):
    assert_matches_reference(
        backend, make_batch(BASE, *SCENARIOS["mixed"], seed=7), **FEATURES[feature]
    )


def _image_bounds(args, images) -> jax.Array:
    """i32[T] causal bounds of batch `args`: each token's position, a token of image (s, a, b)
    (positions [a, b) of sequence s) b - 1."""
    _, _, kv_lens, _, cu, _ = (np.asarray(x) for x in args)
    bound = np.zeros(args[0].shape[0], np.int32)
    for s in range(len(cu) - 1):
        n = cu[s + 1] - cu[s]
        bound[cu[s] : cu[s + 1]] = np.arange(kv_lens[s] - n, kv_lens[s]) if n else 0
    for s, a, b in images:
        first = kv_lens[s] - (cu[s + 1] - cu[s])
        bound[cu[s] + a - first : cu[s] + b - first] = b - 1
    return jnp.asarray(bound)


# "mixed": sequence 2 computes positions 14..19, sequence 3 positions 0..4
IMAGES = [(2, 15, 19), (3, 1, 4)]


@pytest.mark.parametrize("window", [None, 3])
def test_reference_causal_bound_is_the_dense_mask(window):
    """An image token sees every key up to its image's end; the window counts from its position."""
    args = make_batch(BASE, *SCENARIOS["mixed"], seed=11)
    bound = _image_bounds(args, IMAGES)
    out = np.asarray(
        run_reference(*args, sm_scale=0.125, sliding_window=window, causal_bound=bound)
    )
    q, cache, kv_lens, table, cu, _ = (np.asarray(x) for x in args)
    g, ps = BASE.num_q_heads // BASE.num_kv_heads, BASE.page_size
    for s in range(4):
        keys = np.arange(kv_lens[s])
        rows = cache[table[s, keys // ps], keys % ps]  # [K, 2*Hkv, D]
        for t in range(cu[s], cu[s + 1]):
            pos = kv_lens[s] - (cu[s + 1] - t)
            see = keys <= bound[t]
            if window is not None:
                see &= pos - keys < window
            for h in range(BASE.num_q_heads):
                k, v = rows[see, 2 * (h // g)], rows[see, 2 * (h // g) + 1]
                p = np.exp(0.125 * k @ q[t, h] - np.max(0.125 * k @ q[t, h]))
                np.testing.assert_allclose(out[t, h], p @ v / p.sum(), rtol=1e-4, atol=1e-5)
    plain = run_reference(*args, sm_scale=0.125, sliding_window=window)
    assert not np.allclose(out, plain)  # the bound changed the image tokens' rows


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_causal_bound_matches_reference(backend):
    """Image rows past their query block's own keys (blocks of 2 tokens), within a window."""
    args = make_batch(BASE, *SCENARIOS["mixed"], seed=11)
    bound = _image_bounds(args, IMAGES)
    assert_matches_reference(backend, args, sliding_window=3, causal_bound=bound)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_window_skips_pages_before_it(backend):
    """Pages wholly before every query's window are NaN: only a kernel that skips them passes."""
    shape = Shape(pages_per_seq=16)
    args = list(make_batch(shape, [2, 3], [40, 61], seed=11))
    cache, table = np.array(args[1]), np.asarray(args[3])
    cache[table[0, :8]] = np.nan  # keys 0..31 of seq 0; its queries sit at 38, 39 (window 4)
    cache[table[1, :13]] = np.nan  # keys 0..51 of seq 1; queries at 58..60
    args[1] = jnp.asarray(cache)
    kw = dict(sliding_window=4, sm_scale=0.125)
    interpret = interpret_mode(backend)
    blocks = _blocks(SMALL_BLOCKS, interpret)
    out = np.asarray(
        KERNELS[backend](*in_layout(backend, args), interpret=interpret, blocks=blocks, **kw)
    )
    clean = list(make_batch(shape, [2, 3], [40, 61], seed=11))
    ref = np.asarray(run_reference(*clean, **kw))
    np.testing.assert_allclose(out, ref, rtol=0, atol=tol(jnp.float32) * np.abs(ref).max())


@pytest.mark.parametrize("hq,hkv,head_dim", [(4, 4, 64), (6, 2, 128), (16, 2, 64)])
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_gqa_and_head_dim(backend, hq, hkv, head_dim):
    shape = Shape(num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim)
    assert_matches_reference(backend, make_batch(shape, *SCENARIOS["mixed"], seed=hq))


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_bf16(backend):
    args = make_batch(BASE, *SCENARIOS["mixed"], seed=5, dtype=jnp.bfloat16)
    assert_matches_reference(backend, args, soft_cap=3.0)


def _random_case(rng):
    hkv = int(rng.choice([1, 2]))
    shape = Shape(
        num_q_heads=hkv * int(rng.choice([1, 2, 4, 8])),
        num_kv_heads=hkv,
        head_dim=int(rng.choice([64, 128])),
        page_size=int(rng.choice([4, 8, 16])),
        pages_per_seq=8,
        num_pages=80,
        num_tokens=32,
        max_seqs=6,
    )
    n = int(rng.integers(1, shape.max_seqs + 1))
    q_lens = rng.multinomial(int(rng.integers(n, shape.num_tokens + 1)), np.ones(n) / n)
    cap = shape.pages_per_seq * shape.page_size
    q_lens = np.minimum(q_lens, cap)
    kv_lens = [int(rng.integers(q, cap + 1)) for q in q_lens]
    kw = {}
    if rng.random() < 0.4:
        kw["sliding_window"] = int(rng.integers(1, 24))
    if rng.random() < 0.3:
        kw["soft_cap"] = float(rng.uniform(1.0, 10.0))
    if rng.random() < 0.3:
        kw["sinks"] = jnp.asarray(rng.standard_normal(shape.num_q_heads), jnp.float32)
    blocks = SMALL_BLOCKS if rng.random() < 0.5 else None
    return shape, [int(x) for x in q_lens], kv_lens, kw, blocks


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_random_sweep(backend, seed):
    shape, q_lens, kv_lens, kw, blocks = _random_case(np.random.default_rng(seed))
    assert_matches_reference(
        backend, make_batch(shape, q_lens, kv_lens, seed=seed), blocks=blocks, **kw
    )


SPLIT_SHAPE = Shape(page_size=4, pages_per_seq=8, num_tokens=8, max_seqs=3)
SPLIT_CASES = {  # name -> (q_lens, kv_lens, blocks, kernel kwargs); decode_block_q 4: q_len <= 4
    # one sequence: 4 KV blocks over 4 splits (budget 16 / 2 heads = 8 items)
    "batch1": ([1], [30], dict(decode_programs=16), {}),
    # 5 KV blocks over 3 splits (budget 3): shares of 1, 2, 2 blocks
    "uneven": ([1], [19], dict(decode_programs=6, pages_per_block=1), {}),
    # q_len 4 at positions 5..8: split 1 holds key 8 (seen by the last row only), its unused slots
    # and a padded page-table entry (NaN page / out-of-range id): fully masked for the other rows
    "masked_split": ([4], [9], dict(decode_programs=16), {}),
    "window": (
        [3, 1],
        [9, 31],
        dict(decode_programs=16, pages_per_block=1),
        dict(sliding_window=6),
    ),
    "softcap_sinks": (
        [2, 1],
        [17, 25],
        dict(decode_programs=16),
        dict(soft_cap=2.0, sinks=jnp.linspace(-1.0, 2.0, BASE.num_q_heads)),
    ),
    # decodes (split) beside a prefill chunk (the unsplit prefill class)
    "mixed": ([1, 2, 5], [29, 13, 7], dict(decode_programs=16), dict(sliding_window=9)),
}


@pytest.mark.skipif(jax.default_backend() == "tpu", reason="GPU interpret cases run on CPU/GPU")
@pytest.mark.parametrize("case", SPLIT_CASES)
def test_gpu_split_k_matches_reference(case):
    q_lens, kv_lens, over, kw = SPLIT_CASES[case]
    blocks = block_sizes.KernelBlocks(block_q=8, decode_block_q=4, **{"pages_per_block": 2, **over})
    args = make_batch(SPLIT_SHAPE, q_lens, kv_lens, seed=len(case))
    table = block_sizes.split_work_table(
        args[4],
        args[2],
        args[5],
        block_sizes.query_classes(8, 3, blocks)[0],
        budget=block_sizes.split_budget(blocks, BASE.num_kv_heads),
        num_work=16,
        page_size=4,
        block_k=4 * blocks.pages_per_block,
        sliding_window=kw.get("sliding_window"),
    )
    assert int(np.asarray(table.num_splits)[0]) > 1  # the case does split
    assert_matches_reference("gpu", args, blocks=blocks, interpret=True, **kw)


DECODE_SHAPE = Shape(page_size=4, pages_per_seq=8, num_tokens=4, max_seqs=4)
DECODE_CASES = {  # name -> (kv_lens, blocks, kernel kwargs): every live sequence decodes 1 token
    "split": (
        [30, 5, 17],
        dict(decode_programs=24),
        {},
    ),  # 2 splits each (24 // (4 x 2 heads) = 3, a power of two)
    "one_split": ([30, 1, 9, 32], dict(decode_programs=0), {}),
    "window": ([31, 9], dict(decode_programs=16, pages_per_block=1), dict(sliding_window=6)),
    "softcap_sinks": (
        [25, 17, 3],
        dict(decode_programs=16),
        dict(soft_cap=2.0, sinks=jnp.linspace(-1.0, 2.0, BASE.num_q_heads)),
    ),
    "one_token": ([19], dict(decode_programs=64), {}),  # more splits than KV blocks
    "group3": ([22, 7], dict(decode_programs=0), {}),  # G = 3: the masked store of 3 of 16 rows
}
DECODE_SHAPES = {
    "one_token": dataclasses.replace(DECODE_SHAPE, num_tokens=1),
    "group3": dataclasses.replace(DECODE_SHAPE, num_q_heads=6),
}


@pytest.mark.skipif(jax.default_backend() == "tpu", reason="GPU interpret cases run on CPU/GPU")
@pytest.mark.parametrize("case", DECODE_CASES)
def test_gpu_decode_only_path_matches_reference(case):
    """`decode_only`: one launch without query classes or work tables (gpu_decode)."""
    kv_lens, over, kw = DECODE_CASES[case]
    blocks = block_sizes.KernelBlocks(block_q=8, decode_block_q=4, **{"pages_per_block": 2, **over})
    shape = DECODE_SHAPES.get(case, DECODE_SHAPE)
    args = make_batch(shape, [1] * len(kv_lens), kv_lens, seed=len(case))
    ref = np.asarray(run_reference(*args, sm_scale=0.125, **kw))
    out = KERNELS["gpu"](
        *args, sm_scale=0.125, interpret=True, blocks=blocks, decode_only=True, **kw
    )
    out = np.asarray(out)
    assert np.isfinite(out).all() and not out[len(kv_lens) :].any()
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


def test_split_work_table_covers_each_kv_block_once():
    """Balanced shares: every KV block of every decode sequence in exactly one split."""
    blocks = block_sizes.KernelBlocks(
        block_q=8, decode_block_q=2, pages_per_block=2, decode_programs=20
    )
    q_lens, kv_lens = [1, 2, 1, 9, 0], [3, 70, 41, 20, 5]  # a prefill and an idle sequence
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    lens, n = jnp.asarray(kv_lens, jnp.int32), jnp.asarray([5], jnp.int32)
    cls = block_sizes.query_classes(16, 5, blocks)[0]
    table = block_sizes.split_work_table(
        cu, lens, n, cls, budget=10, num_work=12, page_size=4, block_k=8, sliding_window=None
    )
    seq, split, ns, blk = (
        np.asarray(x) for x in (table.seq, table.split, table.num_splits, table.block)
    )
    live = seq >= 0
    # 3 live decodes share the budget of 10: at most 3 splits each, never more than their blocks
    assert seq[live].tolist() == [0, 1, 1, 1, 2, 2, 2]
    assert blk[live].tolist() == [0, 1, 1, 1, 2, 2, 2] and (blk[~live] == cls.num_work).all()
    for s, kv in zip(range(3), kv_lens):
        mine = seq == s
        nb = -(-kv // 8)
        covered = [
            b
            for sp in split[mine]
            for b in range(*block_sizes.split_range(nb, int(sp), int(ns[mine][0])))
        ]
        assert covered == list(range(nb)), s


def test_default_split_fills_an_h100_at_batch_1():
    """Llama-3-8B heads (8 KV heads), page 16, bf16, 4096 context: >= 132 SMs' worth of programs
    at batch 1; at batch 64 every sequence keeps one program per KV head (no splitting)."""
    blocks = block_sizes.get_block_sizes(
        "gpu", head_dim=128, page_size=16, dtype=jnp.bfloat16, group=4, pages_per_seq=256, pow2=True
    )
    assert blocks.decode_programs >= block_sizes.H100_SMS
    budget = block_sizes.split_budget(blocks, 8)
    for n, ctx, want_min, want_max in ((1, 4096, block_sizes.H100_SMS, None), (64, 1024, 0, 64)):
        cu = jnp.arange(n + 1, dtype=jnp.int32)
        cls = block_sizes.query_classes(n, n, blocks)[0]
        table = block_sizes.split_work_table(
            cu,
            jnp.full((n,), ctx, jnp.int32),
            jnp.asarray([n], jnp.int32),
            cls,
            budget=budget,
            num_work=max(cls.num_work, budget),
            page_size=16,
            block_k=16 * blocks.pages_per_block,
            sliding_window=None,
        )
        items = int((np.asarray(table.seq) >= 0).sum())
        assert 8 * items >= want_min and (want_max is None or items == want_max), (n, items)


def test_combine_splits_is_the_softmax_over_all_keys():
    """Merging per-split (normalized output, log-sum-exp) pairs == one softmax; an empty split and
    a dead item's garbage (NaN) change nothing."""
    rng = np.random.default_rng(0)
    scores = rng.standard_normal((2, 12)).astype(np.float32) * 3  # [R, K]
    values = rng.standard_normal((12, 4)).astype(np.float32)  # [K, D]
    p = np.exp(scores - scores.max(1, keepdims=True))
    want = (p / p.sum(1, keepdims=True)) @ values
    outs, lses = [], []
    for lo, hi in ((0, 5), (5, 5), (5, 12)):
        sc = scores[:, lo:hi]
        if hi == lo:
            outs.append(np.zeros((2, 4), np.float32))
            lses.append(np.full(2, -1e30, np.float32))
            continue
        m = sc.max(1, keepdims=True)
        e = np.exp(sc - m)
        outs.append((e / e.sum(1, keepdims=True)) @ values[lo:hi])
        lses.append(m[:, 0] + np.log(e.sum(1)))
    outs.append(np.full((2, 4), np.nan, np.float32))  # a dead item
    lses.append(np.full(2, np.nan, np.float32))
    out = block_sizes.combine_splits(
        jnp.asarray(np.stack(outs))[:, None],
        jnp.asarray(np.stack(lses))[:, None],
        jnp.asarray([0, 0, 0, 1], jnp.int32),
        num_blocks=1,
    )
    np.testing.assert_allclose(np.asarray(out)[0, 0], want, rtol=1e-5, atol=1e-6)


def _races_state():
    try:
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as mosaic_interpret
    except ImportError:  # the interpreter moved (newer JAX): fall back on its printed report
        return None
    return mosaic_interpret


def _assert_race_report(capfd, expect: bool) -> None:
    """Both channels: the printed report (every pallas_call) and the detector's state (the last)."""
    mosaic_interpret = _races_state()
    if mosaic_interpret is not None:
        assert mosaic_interpret.races is not None
        assert mosaic_interpret.races.races_found == expect
    assert ("RACE DETECTED" in capfd.readouterr().out) == expect


CPU_ONLY = pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="the TPU interpreter's race detector runs on a CPU platform",
)


@CPU_ONLY
def test_race_detector_catches_a_racy_kernel(capfd):
    """Reading a DMA's destination before waiting on it is a race: the detector must say so."""

    def racy(x_hbm, o_ref, buf, sem):
        copy = pltpu.make_async_copy(x_hbm, buf, sem)
        copy.start()
        o_ref[...] = buf[...]
        copy.wait()

    x = jnp.ones((8, 128), jnp.float32)
    pl.pallas_call(
        racy,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        scratch_shapes=[pltpu.VMEM(x.shape, x.dtype), pltpu.SemaphoreType.DMA(())],
        interpret=pltpu.InterpretParams(detect_races=True),
    )(x).block_until_ready()
    _assert_race_report(capfd, expect=True)


@CPU_ONLY
@pytest.mark.parametrize(
    "feature,dma_mode", [("none", "on_wait"), ("window_softcap_sinks", "eager")]
)
def test_tpu_kernel_has_no_races(capfd, feature, dma_mode):
    """NOTE: reading the in-flight buffer slot instead of the waited one is reported (checked by
    hand: 14 reports in either DMA mode), so a double-buffering mistake would fail here."""
    interpret = pltpu.InterpretParams(detect_races=True, dma_execution_mode=dma_mode)
    assert_matches_reference(
        "tpu",
        make_batch(BASE, *SCENARIOS["mixed"], seed=9),
        interpret=interpret,
        **FEATURES.get(feature, {}),
    )
    _assert_race_report(capfd, expect=False)


@pytest.mark.parametrize(
    "backend,platform,marker", [("gpu", "cuda", "triton"), ("tpu", "tpu", "tpu_custom_call")]
)
def test_kernel_lowers_for_its_platform(backend, platform, marker):
    """Triton IR / Mosaic lowering of a production-sized call with the table's block sizes."""
    shape = Shape(
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        page_size=16,
        pages_per_seq=16,
        num_pages=64,
        num_tokens=64,
        max_seqs=8,
    )
    args = in_layout(
        backend, make_batch(shape, [1, 1, 1, 30], [40, 17, 200, 64], dtype=jnp.bfloat16)
    )
    kw = dict(
        sm_scale=0.088, sliding_window=128, soft_cap=30.0, sinks=jnp.zeros((32,), jnp.float32)
    )
    if backend == "gpu":
        # NOTE: Triton lowering reads the target GPU from the abstract mesh's device (JAX 0.11
        # refuses to lower for a GPU without one), and lowers abstract arguments only.
        device = jax.sharding.AbstractDevice(
            device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda"
        )
        mesh = jax.sharding.AbstractMesh(
            (1,), ("x",), (jax.sharding.AxisType.Explicit,), abstract_device=device
        )
        with jax.sharding.use_abstract_mesh(mesh):
            args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
            kw["sinks"] = jax.ShapeDtypeStruct((32,), jnp.float32)
            lowered = KERNELS[backend].trace(*args, **kw).lower(lowering_platforms=(platform,))
    else:
        lowered = KERNELS[backend].trace(*args, **kw).lower(lowering_platforms=(platform,))
    text = lowered.as_text()
    assert text.count(marker) >= 2  # a decode-class and a prefill-class call
    if backend == "gpu":
        assert "ragged_paged_attention_bq4_split_k" in text  # split-K decode for 8B heads


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cache_write_is_exact(dtype):
    rng = np.random.default_rng(0)
    p, ps, hkv, d, t = 6, 4, 2, 8, 10
    cache = np.full((p, ps, 2 * hkv, d), np.nan, np.float32)
    cache[1] = rng.standard_normal((ps, 2 * hkv, d))
    k = rng.standard_normal((t, hkv, d)).astype(np.float32)
    v = rng.standard_normal((t, hkv, d)).astype(np.float32)
    slots = np.array([5, 6, 7, 8, 21, -1, 0, 23, -1, 12], np.int32)
    new = reference.update_kv_cache(
        jnp.asarray(cache, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(slots)
    )
    want = np.array(jnp.asarray(cache, dtype))
    kv = np.stack([np.asarray(jnp.asarray(k, dtype)), np.asarray(jnp.asarray(v, dtype))], axis=2)
    for i, slot in enumerate(slots):
        if slot >= 0:
            want[slot // ps, slot % ps] = kv[i].reshape(2 * hkv, d)
    got = np.asarray(new)
    assert got.dtype == want.dtype
    assert got.tobytes() == want.tobytes()  # bit for bit, NaNs of untouched slots included


@pytest.mark.parametrize("backend", ["reference", *BACKEND_PARAMS])
def test_bad_shapes_and_dtypes_raise(backend):
    q, cache, lens, table, cu, n = in_layout(backend, make_batch(BASE, [1], [3]))
    fn = functools.partial(KERNELS[backend], sm_scale=1.0, interpret=interpret_mode(backend))
    with pytest.raises(ValueError, match="head_dim"):
        fn(q[..., :32], cache, lens, table, cu, n)
    with pytest.raises(ValueError, match="multiple"):
        fn(q[:, :3], cache, lens, table, cu, n)
    with pytest.raises(ValueError, match="int32"):
        fn(q, cache, lens.astype(jnp.float32), table, cu, n)
    with pytest.raises(ValueError, match="sequences"):
        fn(q, cache, lens, table, cu[:-1], n)
    if backend != "reference":
        with pytest.raises(ValueError, match="sinks"):
            fn(q, cache, lens, table, cu, n, sinks=jnp.zeros(3))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU kernel runs on a CPU platform")
def test_cpu_kernel_odd_head_dim_and_mixed_dtypes():
    """head_dim outside the compiled sizes (64/128/256) and an f32 query over a bf16 cache."""
    q, cache, *meta = make_batch(Shape(head_dim=40), *SCENARIOS["mixed"], seed=9)
    assert_matches_reference("cpu", (q, cache, *meta), sliding_window=6)
    q, cache, *meta = make_batch(BASE, *SCENARIOS["mixed"], seed=10)
    cache = cache.astype(jnp.bfloat16)
    ref = np.asarray(run_reference(q, cache, *meta, sm_scale=0.125))
    out = KERNELS["cpu"](q, cache, *meta, sm_scale=0.125)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, ref, rtol=0, atol=tol(jnp.float32) * np.abs(ref).max())


# Long sequences for the CPU kernel's key chunks (256 keys; a chunk doubles past 64 of them):
# a decode over 5 chunks, a 3-token speculative check over 3, one just past a chunk boundary, a
# 12-token prefill tile (not cut: more than 8 tokens).
LONG = Shape(page_size=16, pages_per_seq=72, num_pages=200, num_tokens=32, max_seqs=4)
LONG_LENS = ([1, 3, 1, 12], [1100, 600, 257, 700])


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU kernel runs on a CPU platform")
@pytest.mark.parametrize(
    "feature",
    [
        {},
        dict(sliding_window=300),  # the window's first key inside a later chunk
        dict(soft_cap=2.0, sinks=jnp.linspace(-1.0, 2.0, LONG.num_q_heads)),  # sinks: once
    ],
    ids=["plain", "window", "softcap_sinks"],
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cpu_kernel_key_chunks_match_reference(feature, dtype):
    """Decodes over keys in several chunks, merged after the threads are done: the reference's
    softmax over all keys, and every sequence's rows the same bits alone as in the batch (the cut
    depends on the sequence, not on the batch or on how items are spread over threads)."""
    args = make_batch(LONG, *LONG_LENS, seed=21, dtype=dtype)
    assert_matches_reference("cpu", args, blocks=None, **feature)
    kw = dict(sm_scale=0.125, **feature)
    together = np.asarray(KERNELS["cpu"](*args, **kw), np.float32)
    q, cache, lens, table, cu, _ = args
    start = 0
    for s, q_len in enumerate(LONG_LENS[0]):
        # sequence s alone: its page-table row first, its tokens at the front
        alone_q = jnp.zeros_like(q).at[:q_len].set(q[start : start + q_len])
        alone = KERNELS["cpu"](
            alone_q,
            cache,
            lens.at[0].set(lens[s]),
            table.at[0].set(table[s]),
            jnp.asarray([0] + [q_len] * LONG.max_seqs, jnp.int32),
            jnp.asarray([1], jnp.int32),
            **kw,
        )
        np.testing.assert_array_equal(
            np.asarray(alone, np.float32)[:q_len], together[start : start + q_len]
        )
        start += q_len


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU kernel runs on a CPU platform")
def test_cpu_kernel_chunks_grow_for_long_sequences():
    """Past 64 chunks of 256 keys a sequence's chunk doubles (at most 64 a decode): 17,000 keys."""
    shape = Shape(
        num_q_heads=2,
        num_kv_heads=1,
        page_size=64,
        pages_per_seq=272,
        num_pages=280,
        num_tokens=8,
        max_seqs=2,
    )
    assert_matches_reference("cpu", make_batch(shape, [1, 2], [17000, 300], seed=5), blocks=None)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU kernel runs on a CPU platform")
def test_cpu_kernel_small_decode_takes_a_lingering_helper_with_the_same_bits():
    """A decode too small to wake pool threads (8 rows x 1,000 keys) takes the linear kernel's
    lingering helper when one is spinning (`cpu_helpers.h`: one mailbox for both libraries), and
    gives the same bits as on the caller alone."""
    from pallas_kernels.linear import cpu as linear_cpu
    from pallas_kernels.ragged_paged_attention import cpu as attention_cpu

    if not linear_cpu.available():
        pytest.skip(f"no linear kernel here: {linear_cpu.unavailable_reason()}")
    lib = attention_cpu.library()
    box, linear_box = lib.JaxinferCpuAttentionHelperBox, linear_cpu.library().JaxinferCpuHelperBox
    box.restype = linear_box.restype = ctypes.c_void_p
    assert box() == linear_box()  # the attention library posts to the products' helpers
    helped, linger = lib.JaxinferCpuAttentionHelped, lib.JaxinferCpuAttentionLinger
    helped.restype, linger.argtypes = ctypes.c_int64, [ctypes.c_int64]
    shape = Shape(page_size=16, pages_per_seq=64, num_pages=70, num_tokens=8, max_seqs=2)
    args = make_batch(shape, [1], [1000], seed=9)
    call = jax.jit(functools.partial(KERNELS["cpu"], sm_scale=0.125))
    before = helped()
    alone = np.asarray(call(*args))
    assert helped() == before  # nothing lingering: the caller ran every item
    # A helper spinning for the next 0.2 s, as after a product (again while none has taken an
    # item: on a busy machine the spinning thread may wait for a core longer than a few calls)
    deadline, armed = time.monotonic() + 20.0, 0.0
    while helped() == before:
        assert time.monotonic() < deadline, "no lingering helper took an attention item in 20 s"
        if time.monotonic() > armed + 0.2:
            linger(200_000_000)
            armed = time.monotonic()
        np.testing.assert_array_equal(np.asarray(call(*args)), alone)


def test_gpu_rejects_non_power_of_two_head_dim():
    shape = Shape(head_dim=48)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        KERNELS["gpu"](*make_batch(shape, [1], [3]), sm_scale=1.0, interpret=True)


def test_check_values_rejects_bad_metadata():
    q, cache, lens, table, cu, n = make_batch(BASE, [2, 3], [4, 9])
    reference.check_values(q, cache, lens, table, cu, n)
    bad = {
        "num_seqs": (q, cache, lens, table, cu, jnp.asarray([5], jnp.int32)),
        "never decrease": (q, cache, lens, table, cu.at[1].set(6), n),
        "q_len": (q, cache, lens.at[0].set(1), table, cu, n),
        "pages_per_seq": (q, cache, lens.at[1].set(33), table, cu, n),
        "page ids": (q, cache, lens, table.at[1, 2].set(BASE.num_pages), cu, n),
    }
    for match, args in bad.items():
        with pytest.raises(ValueError, match=match):
            reference.check_values(*args)
    # padded page-table entries are not checked
    reference.check_values(q, cache, lens, table.at[1, 5].set(-7), cu, n)


def test_dispatch():
    """Explicit platforms, so the same assertions hold on a CPU, GPU or TPU host."""
    assert attn.resolve_backend("auto", "gpu") == "gpu"
    assert attn.resolve_backend("auto", "tpu") == "tpu"
    # the compiled CPU kernel builds on the CI machine (a CPU platform); elsewhere it may not
    want_cpu = ("cpu",) if jax.default_backend() == "cpu" else ("cpu", "reference")
    assert attn.resolve_backend("auto", "cpu") in want_cpu
    # the default (None) is "auto": the compiled kernel on CPU, the Pallas kernels on GPU and TPU
    assert attn.resolve_backend(None, "cpu") in want_cpu
    assert attn.resolve_backend(None, "gpu") == attn.resolve_backend(None, "cuda") == "gpu"
    assert attn.resolve_backend(None, "tpu") == "tpu"
    assert attn.resolve_backend("reference", "tpu") == "reference"  # still selectable
    assert attn.resolve_backend("tpu", "cpu") == "tpu"
    with pytest.raises(ValueError, match="CPU platform only"):
        attn.resolve_backend("cpu", "gpu")
    for bad in ("triton", ""):
        with pytest.raises(ValueError, match="attention_backend"):
            attn.resolve_backend(bad)
        with pytest.raises(ValueError, match="attention_backend"):
            attn.kv_cache_shape(bad, 4, 16, 2, 64)
    for backend in attn.BACKENDS:
        if backend == "cpu" and jax.default_backend() != "cpu":
            with pytest.raises(ValueError, match="CPU platform only"):
                attn.kv_cache_shape(backend, 4, 16, 2, 64)
            continue
        want = (4, 2, 16, 128) if backend == "tpu" else (4, 16, 4, 64)  # tpu_layout's own
        assert attn.kv_cache_shape(backend, 4, 16, 2, 64) == want
    assert attn.kv_cache_shape(None, 4, 16, 2, 64, platform="tpu") == (4, 2, 16, 128)


def test_attention_op_with_each_backend():
    """attention(): the same cache (bit for bit) and the same output for every backend."""
    q, cache, lens, table, cu, n = make_batch(BASE, *SCENARIOS["mixed"], seed=2)
    rng = np.random.default_rng(2)
    k, v = (jnp.asarray(rng.standard_normal((BASE.num_tokens, 2, 64)), jnp.float32) for _ in "kv")
    # new tokens go to the last q_len positions of each sequence
    slots = np.full(BASE.num_tokens, -1, np.int32)
    cu_np, lens_np, table_np = np.asarray(cu), np.asarray(lens), np.asarray(table)
    for s in range(int(n[0])):
        for i, t in enumerate(range(cu_np[s], cu_np[s + 1])):
            pos = lens_np[s] - (cu_np[s + 1] - cu_np[s]) + i
            slots[t] = table_np[s, pos // BASE.page_size] * BASE.page_size + pos % BASE.page_size
    step = StepInputs(
        token_ids=jnp.zeros(BASE.num_tokens, jnp.int32),
        positions=jnp.zeros(BASE.num_tokens, jnp.int32),
        slot_mapping=jnp.asarray(slots),
        kv_lens=lens,
        page_indices=table,
        cu_q_lens=cu,
        num_seqs=n,
        logits_indices=jnp.zeros(1, jnp.int32),
    )
    outs = {
        b: attn.attention(
            q, k, v, in_layout(b, (q, cache))[1], step, sm_scale=0.125, sliding_window=6, backend=b
        )
        for b in ("reference", *RUNNABLE)
    }
    ref_out, ref_cache = outs["reference"]
    for b, (out, new_cache) in outs.items():
        want = in_layout(b, (q, ref_cache))[1]
        assert np.asarray(new_cache).tobytes() == np.asarray(want).tobytes(), b
        np.testing.assert_allclose(
            out, ref_out, rtol=0, atol=tol(jnp.float32) * np.abs(ref_out).max()
        )


def _greedy_tokens(monkeypatch, family: str, backend: str, steps: int) -> list[list[int]]:
    # NOTE: two layers for Gemma 2 (its tiny config has four): one sliding-window and one global
    # layer, so both attention kinds still run each kernel, at half the program size; Llama's
    # layers are all alike: one (each interpreted kernel layer costs trace, compile and run time).
    layers = 2 if family == "gemma2" else 1
    cfg = ModelConfig.from_hf({**hf_config_dict(family), "num_hidden_layers": layers})
    params = init_random(llama.param_specs(cfg), jax.random.PRNGKey(0))
    params = jax.tree.map(lambda x: x * 6.0, params)  # peaky logits: no near-ties in argmax
    traced = []  # the kernel each layer's attention traced (a fresh jit, so it always traces)
    resolved = attn.resolve_backend(backend)
    kernel = attn.KERNELS[resolved]
    monkeypatch.setitem(attn.KERNELS, resolved, lambda *a, **k: traced.append(k) or kernel(*a, **k))

    def forward(params, cfg, step, kv_caches):
        return llama.forward(params, cfg, step, kv_caches, attention_backend=backend)

    # PagedStepper calls llama.forward_jit(params, cfg, step, caches)
    monkeypatch.setattr(llama, "forward_jit", jax.jit(forward, static_argnames=("cfg",)))
    stepper = PagedStepper(params, cfg, page_size=4, num_pages=64, seed=1)
    stepper.caches = tuple(in_layout(resolved, (None, c))[1] for c in stepper.caches)
    prompts = {0: [3, 17, 101, 9, 44, 250, 7], 1: [88, 2, 61, 5, 190]}
    last = stepper.step(list(prompts.items()))  # 12 tokens: the 16-token bucket
    tokens = {sid: [] for sid in prompts}
    for _ in range(steps):
        chunks = []
        for (sid, _), logits in zip(prompts.items(), last):
            tokens[sid].append(int(np.argmax(logits[-1])))
            chunks.append((sid, [tokens[sid][-1]]))
        last = stepper.step(chunks, pad_tokens=14)  # same 16-token bucket: no recompile
    assert len(traced) == cfg.num_layers  # one trace of each layer's attention, on this backend
    if jax.default_backend() == "cpu":
        assert all(bool(k["interpret"]) == (resolved in ("gpu", "tpu")) for k in traced)
    return [tokens[sid] for sid in prompts]


@pytest.mark.parametrize("family", ["llama", pytest.param("gemma2", marks=pytest.mark.slow)])
def test_greedy_tokens_equal_across_backends(monkeypatch, family):
    want = _greedy_tokens(monkeypatch, family, "reference", steps=4)
    for backend in RUNNABLE:
        assert _greedy_tokens(monkeypatch, family, backend, steps=4) == want, backend


ENGINE_PROMPTS = [[5, 300, 41, 7000, 12, 9], [88, 2, 61, 5, 190, 77, 1000, 3, 4]]
# NOTE: one token bucket: the prefill (15 tokens) and the decodes (2) run one step program, so
# each backend's engine compiles its (interpreted) kernels once, not once per power of two; one
# layer (the engine test model's layers are alike): each interpreted layer costs trace, compile
# and run time.
ENGINE_BUCKETS = (16,)
ENGINE_LAYERS = 1


@pytest.fixture(scope="module")
def engine_reference():
    """The tiny engine model and its greedy tokens on the reference backend (built once)."""
    from tests import engine_utils as eu

    model = eu.tiny_model(eu.load_vocab(), num_layers=ENGINE_LAYERS)
    engine, tokens = eu.greedy_ids_on_backends(
        model, ENGINE_PROMPTS, 6, token_buckets=ENGINE_BUCKETS, attention_backend="reference"
    )
    assert engine.runner.attention_backend == "reference"
    return model, tokens


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_engine_runs_on_kernel_backend(engine_reference, backend):
    """The engine option reaches the kernel: same greedy tokens as the reference backend."""
    from tests import engine_utils as eu

    model, want = engine_reference
    engine, got = eu.greedy_ids_on_backends(
        model, ENGINE_PROMPTS, 6, token_buckets=ENGINE_BUCKETS, attention_backend=backend
    )
    assert engine.runner.attention_backend == backend
    assert got == want
