"""Every shipped kernel configuration compiles for the accelerators, without them (issue 30).

1. TPU (v5e and v6e, libtpu): the ragged paged attention Mosaic kernel for each TPU row of the
   block-size table and the default at other page sizes, bf16 / f32 / fp8 KV caches, with and
   without sliding window + soft-cap + sinks (+ a per-token `causal_bound`: image tokens). Configurations that give the same kernel are
   compiled once: each case differs in block sizes, dtype, page size, head layout or feature;
   all of a chip's cases compile as one program (v6e: the cases where it differs from v5e).
   Mosaic checks what interpret mode never does (tile alignment, VMEM limits).
   The in-place KV write kernel (`tpu_write`) compiles alongside (bf16 and fp8 caches).
2. The TPU cache layout is read in place: a SmolLM2 decode (cache write + attention) compiled for
   v5e holds no cache-sized copy in its optimized HLO and accesses <= 2x its KV cache bytes; a
   cache small enough for VMEM is not moved there, and the write moves only its tokens' tiles.
3. Cost estimates: XLA's cost analysis of a kernel call counts the kernel (flops and bytes of
   `paged_common.attention_cost`), not the zero of an opaque custom call.
4. H100 (CUDA plugin): the Triton kernels for the GPU rows of the table, split-K decode on and
   off, a per-token `causal_bound`, an fp8 cache, and the MLA kernel compile to sm_90a code (a too-large block would fail here
   with RESOURCE_EXHAUSTED), each family as one program; a failing program is recompiled case by
   case so the failure names the configurations.
Each check skips when its plugin is absent (tests/accel_utils.py).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import pytest

from jaxinfer import attention as attn
from pallas_kernels import mla_paged_attention
from pallas_kernels.ragged_paged_attention import block_sizes, gpu, tpu, tpu_write
from tests.accel_utils import h100_device, on, tpu_device


@dataclasses.dataclass(frozen=True)
class Case:
    hq: int = 32
    hkv: int = 8
    head_dim: int = 128
    page_size: int = 16
    dtype: str = "bfloat16"
    fp8: bool = False
    features: bool = False  # sliding window, soft-cap and sinks
    bound: bool = False  # a per-token causal bound (image tokens see their whole image)
    num_pages: int = 64
    tokens: int = 32  # a decode class and a prefill class
    max_seqs: int = 4
    pages_per_seq: int = 16


TPU_CASES = {  # the plain 8B and SmolLM2 kernels (bf16, fp8) compile in the tests below
    "8b_p16_bf16_features": Case(features=True, bound=True),  # (fp8_features: no bound)
    "8b_p32_bf16": Case(page_size=32, pages_per_seq=8),
    "8b_p16_f32": Case(dtype="float32"),
    "8b_p16_fp8_features": Case(fp8=True, features=True),
    "smollm2_p16_fp8": Case(hq=9, hkv=3, head_dim=64, fp8=True),
    "default_p8_group7": Case(hq=28, hkv=4, page_size=8, pages_per_seq=32),
    "default_p128": Case(page_size=128, pages_per_seq=2),
}
# v6e: what differs from v5e is the MXU (256 wide) and the VMEM budget; the cases with the most
# VMEM per program (fp8's exponent buffers, 32 pages of 8, f32) and the features.
V6E_CASES = (
    "8b_p16_bf16_features",
    "8b_p16_fp8_features",
    "default_p8_group7",
    "8b_p16_f32",
    "write_8b_p32_fp8",
)


def _args(case: Case, backend: str):
    """Abstract (q, cache, kv_lens, page_indices, cu_q_lens, num_seqs) and the keywords."""
    sds = jax.ShapeDtypeStruct
    dtype = jnp.dtype(case.dtype)
    shape = attn.kv_cache_shape(
        backend, case.num_pages, case.page_size, case.hkv, case.head_dim, platform=backend
    )
    kind = "fp8" if case.fp8 else "auto"
    cache = jax.eval_shape(lambda: attn.new_kv_cache(shape, dtype, kind, backend, backend))
    s = case.max_seqs
    args = (
        sds((case.tokens, case.hq, case.head_dim), dtype),
        cache,
        sds((s,), jnp.int32),
        sds((s, case.pages_per_seq), jnp.int32),
        sds((s + 1,), jnp.int32),
        sds((1,), jnp.int32),
    )
    kw = {"sm_scale": case.head_dim**-0.5}
    if case.features:
        kw |= {"sliding_window": 128, "soft_cap": 30.0}
    sinks = sds((case.hq,), jnp.float32) if case.features else None
    return args, sinks, kw


def _call(kernel, device, case: Case, backend: str, **extra):
    """(fn, abstract args on `device`) of one kernel configuration."""
    args, sinks, kw = _args(case, backend)
    bound = jax.ShapeDtypeStruct((case.tokens,), jnp.int32) if case.bound else None

    def call(*a):
        *a, sinks, bound = a
        return kernel(*a, sinks=sinks, causal_bound=bound, interpret=False, **kw, **extra)

    return call, on(device, (*args, sinks, bound))


def _compile(kernel, device, case: Case, backend: str, **extra):
    call, args = _call(kernel, device, case, backend, **extra)
    return jax.jit(call).lower(*args).compile()


def _compile_all(calls: dict[str, tuple]):
    """One program calling every configuration (one compile, not one per configuration); when it
    fails, each configuration alone, so the failure names the ones that do not compile."""

    def program(*args):
        return [fn(*a) for (fn, _), a in zip(calls.values(), args)]

    try:
        return jax.jit(program).lower(*[a for _, a in calls.values()]).compile()
    except Exception:
        failed = {}
        for name, (fn, a) in calls.items():
            try:
                jax.jit(fn).lower(*a).compile()
            except Exception as e:
                failed[name] = str(e).splitlines()[0][:300]
        pytest.fail(f"configurations that do not compile: {failed}")


# The in-place KV write kernel (`tpu_write`): bf16 at SmolLM2's heads, fp8 (values and exponent
# rows) at 8B's; f32 and pages smaller than a tile: tests/test_tpu_write.py (interpret mode).
WRITE_CASES = {
    "write_smollm2_p16_bf16": Case(hq=9, hkv=3, head_dim=64),
    "write_8b_p32_fp8": Case(fp8=True, page_size=32),
}


def _write_call(device, case: Case):
    """(fn, abstract args on `device`) of one KV write: `case.tokens` tokens into its cache."""
    (_, cache, *_), _, _ = _args(case, "tpu")
    dtype = jnp.float32 if case.dtype == "float32" else jnp.bfloat16
    kv = jax.ShapeDtypeStruct((case.tokens, case.hkv, case.head_dim), dtype)
    slots = jax.ShapeDtypeStruct((case.tokens,), jnp.int32)
    return tpu_write.update_kv_cache, on(device, (cache, kv, kv, slots))


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_tpu_kernel_compiles(chip):
    device = tpu_device(chip)
    names = TPU_CASES if chip == "v5e" else V6E_CASES
    calls = {
        n: _call(tpu.ragged_paged_attention, device, TPU_CASES[n], "tpu")
        for n in names
        if n in TPU_CASES
    }
    writes = {
        n: _write_call(device, c) for n, c in WRITE_CASES.items() if n in names or chip == "v5e"
    }
    compiled = _compile_all(calls | writes)
    n = compiled.as_text().count('custom_call_target="tpu_custom_call"')
    assert n == 2 * len(calls) + len(writes)


SMOLLM2 = Case(hq=9, hkv=3, head_dim=64, tokens=8, max_seqs=8, pages_per_seq=64)


def _cache_copies(compiled, cache) -> list[str]:
    hlo = compiled.as_text()
    found = []
    for leaf in jax.tree.leaves(cache):
        dims = ",".join(map(str, leaf.shape))
        found += [ln for ln in hlo.splitlines() if re.search(rf"\[{dims}\].* copy(-start)?\(", ln)]
    return found


@pytest.mark.parametrize("fp8,num_pages", [(False, 16384), (True, 16384), (False, 64)])
def test_tpu_cache_is_read_in_place(fp8, num_pages):
    """A 200 MiB SmolLM2 layer cache (larger than VMEM), compiled for v5e: neither the cache write
    (the `tpu_write` kernel) nor the kernel copies it, and the decode's bytes accessed stay under
    2x the cache (the reference layout was copied whole on every call: BENCHMARKS.md). A 64-page
    cache (fits VMEM): not moved there either (XLA's scatter write had memory-space assignment
    copy it whole into VMEM and back), and the write moves only its tokens' tiles.

    NOTE: write and read are compiled apart: the fused layer program took minutes in XLA's cost
    analysis on this machine."""
    device = tpu_device("v5e")
    case = dataclasses.replace(SMOLLM2, num_pages=num_pages, fp8=fp8)
    args, _, kw = _args(case, "tpu")
    q, cache, lens, table, cu, n = on(device, args)
    kv = on(device, jax.ShapeDtypeStruct((case.tokens, case.hkv, case.head_dim), jnp.bfloat16))
    slots = on(device, jax.ShapeDtypeStruct((case.tokens,), jnp.int32))
    write = jax.jit(tpu_write.update_kv_cache, donate_argnums=0).lower(cache, kv, kv, slots)
    write = write.compile()

    def read(*a):
        return tpu.ragged_paged_attention(*a, interpret=False, **kw)

    read = jax.jit(read).lower(q, cache, lens, table, cu, n).compile()
    cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
    for compiled in (write, read):
        assert not _cache_copies(compiled, cache)
        # NOTE: the toy cache's read is dominated by what does not scale with the cache
        big = num_pages > 64
        assert 0 < compiled.cost_analysis()["bytes accessed"] <= 2 * cache_bytes or not big
    # each token's tile of 8 rows (fp8: and its page's exponent row) in and out, and the XLA ops
    # that make the rows (fp8: quantize): a few tiles' worth, not the cache's
    tile = case.hkv * 8 * 2 * case.head_dim * (1 if fp8 else 2) + (case.hkv * 128 * 4 if fp8 else 0)
    assert write.cost_analysis()["bytes accessed"] <= 4 * 2 * case.tokens * tile < cache_bytes


def test_tpu_cost_estimate_counts_the_kernel():
    """flops of each query class's call: 2 dots of rows x keys x D per program (keys bounded by
    the page table), one exp per score; bytes: at least the cache pages each call can reach
    (`attention_cost`). NOTE: no upper bound on bytes here: XLA's TPU cost analysis also counts
    a custom call's whole operands (the cache once per call) at this toy size."""
    case = Case(tokens=4)
    compiled = _compile(tpu.ragged_paged_attention, tpu_device("v5e"), case, "tpu")
    blocks = block_sizes.get_block_sizes(
        "tpu", head_dim=128, page_size=16, dtype=jnp.bfloat16, group=4, pages_per_seq=16, pow2=False
    )
    classes = block_sizes.query_classes(case.tokens, case.max_seqs, blocks)
    assert len(classes) == 2  # a decode and a prefill call
    keys = case.pages_per_seq * case.page_size
    want = sum(4 * c.num_work * case.hkv * c.block_q * 4 * keys * case.head_dim for c in classes)
    cache_bytes = case.num_pages * case.hkv * case.page_size * 2 * case.head_dim * 2
    reach = sum(min(c.num_work * case.pages_per_seq, case.num_pages) for c in classes)
    cost = compiled.cost_analysis()
    assert want <= cost["flops"] <= 1.5 * want
    assert want / (2 * 2 * case.head_dim) <= cost["transcendentals"] <= 1.5 * want / 512
    assert cost["bytes accessed"] >= cache_bytes * reach // case.num_pages


GPU_CASES = {  # the GPU rows of the table; split-K on (the default decode) and off
    "8b_p16_bf16_split_k": (Case(bound=True), {}),
    "8b_p16_bf16_no_split": (Case(features=True), {"split": False}),
    "8b_p32_bf16": (Case(page_size=32, pages_per_seq=8), {}),
    "smollm2_p16_bf16": (Case(hq=9, hkv=3, head_dim=64), {}),
    "8b_p16_f32": (Case(dtype="float32"), {}),
    "8b_p16_fp8": (Case(fp8=True), {}),
}
# The decode-only path (`gpu_decode`, every sequence one token): window + soft-cap + sinks, a
# group of 3 (its masked store of G rows), fp8; each splits its KV range and merges in a launch.
GPU_DECODE_CASES = {
    "8b_p16_bf16_features": Case(features=True, tokens=4),
    "smollm2_p16_bf16": Case(hq=9, hkv=3, head_dim=64, tokens=4),
    "8b_p16_fp8": Case(fp8=True, tokens=1),
}


def _triton_calls(compiled) -> int:
    """Triton kernels in the compiled program (a deviceless GPU compile has no cost analysis)."""
    return compiled.as_text().count('custom_call_target="__gpu$xla.gpu.triton"')


def test_gpu_kernel_compiles_for_h100():
    device = h100_device()
    calls = {}
    for name, (case, opts) in GPU_CASES.items():
        extra = {}
        if opts.get("split") is False:
            blocks = block_sizes.get_block_sizes(
                "gpu",
                head_dim=case.head_dim,
                page_size=case.page_size,
                dtype=case.dtype,
                group=case.hq // case.hkv,
                pages_per_seq=case.pages_per_seq,
                pow2=True,
            )
            extra["blocks"] = dataclasses.replace(blocks, decode_programs=0)
        calls[name] = _call(gpu.ragged_paged_attention, device, case, "gpu", **extra)
    for name, case in GPU_DECODE_CASES.items():
        kernel = functools.partial(gpu.ragged_paged_attention, decode_only=True)
        calls[f"{name}_decode"] = _call(kernel, device, case, "gpu")
    compiled = _compile_all(calls)
    # a decode and a prefill class each; the decode-only path: its kernel and the split-K merge
    assert _triton_calls(compiled) >= 2 * len(calls)


def test_mla_kernel_compiles_for_h100():
    """The default blocks for 576-wide rows fit the H100's shared memory (a block holds
    block_q x heads query rows): DeepSeek-V2-Lite (16 heads), and V3's 128 heads unsharded."""
    device = h100_device()
    sds = jax.ShapeDtypeStruct
    fn = mla_paged_attention.gpu.mla_ragged_paged_attention
    t, lat, rope, pages, s = 32, 512, 64, 64, 4

    def call(*a):
        return fn(*a, sm_scale=0.1, kv_lora_rank=lat, interpret=False)

    calls = {}
    for heads, ps in ((16, 16), (128, 32)):
        args = (
            sds((t, heads, lat + rope), jnp.bfloat16),
            sds(mla_paged_attention.kv_cache_shape(pages, ps, lat, rope), jnp.bfloat16),
            sds((s,), jnp.int32),
            sds((s, 16), jnp.int32),
            sds((s + 1,), jnp.int32),
            sds((1,), jnp.int32),
        )
        calls[f"{heads}_heads_p{ps}"] = (call, on(device, args))
    assert _triton_calls(_compile_all(calls)) >= len(calls)
