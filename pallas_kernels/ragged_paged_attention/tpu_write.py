"""The TPU KV write as a Pallas (Mosaic) kernel that updates the cache's pages in place.

XLA writes a step's K/V rows (`tpu_layout.update_kv_cache`) as a scatter into the layer cache; in
a small cache XLA's memory-space assignment moved the whole layer cache into VMEM to update it
(a `copy-start` of the cache per layer per step, BENCHMARKS.md "Deviceless compiles"). This
kernel takes the cache pinned to HBM (`pltpu.with_memory_space_constraint`: the operand's memory
space is what XLA's assignment sees) and aliased to its output (the same buffer), and moves only
the tiles its tokens touch.

Flow of `update_kv_cache` (same values as `tpu_layout.update_kv_cache`, fp8 rounding included):
  1. Outside the kernel (XLA, token-sized): each token's K and V rows `[T, Hkv, 1, W]` in the
     cache dtype (fp8: `reference.quantize_kv_rows`, and an exponent row `i32[T, Hkv, 1, E]`
     holding K's exponent in lane `offset` and V's in lane `page_size + offset`); the token
     count padded to a whole block with slot -1.
  2. One program per block of `BLOCK` tokens (grid steps run in order), `slot_mapping`
     scalar-prefetched into SMEM. A token's rows land in slot `offset` of its page for every KV
     head: `cache[page, :, offset, :]`. Mosaic DMAs HBM only in whole tiles along the slot axis
     (8 rows), so a program reads the `[Hkv, CHUNK, W]` chunk holding each valid token's slot
     (fp8: also its page's exponent rows `[Hkv, 1, E]`) into VMEM (all reads in flight at once).
  3. The last token of each chunk in the block (no later valid token in the same chunk) writes
     its chunk: it merges the rows of every valid token of the block in that chunk (a row select,
     no arithmetic) and DMAs the chunk back; the exponent rows likewise per page. Each chunk is
     read and written once per block, by one DMA each way; tokens with slot < 0 (padding) move
     nothing.

NOTE: rows are merged by select in the cache dtype; slots within one step are distinct (the
scheduler gives each token its own slot), so the merge order does not matter.
NOTE: a page_size that is not a multiple of 8 rows makes a chunk the whole page.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.paged_common import Interpret
from pallas_kernels.ragged_paged_attention.reference import Fp8KVCache, quantize_kv_rows

BLOCK = 8  # tokens per program (default): their DMAs are in flight together
TILE_ROWS = 8  # Mosaic's HBM tile along the slot axis (every cache dtype)


def chunk_rows(page_size: int) -> int:
    """Slots moved per token: one HBM tile of rows, or the whole page when tiles do not divide
    it."""
    return TILE_ROWS if page_size % TILE_ROWS == 0 else page_size


def _kernel(
    slots_ref,  # SMEM i32[T_padded]
    rows_ref,  # VMEM [block, Hkv, 1, W] cache dtype
    *rest,  # (exps VMEM i32[block, Hkv, 1, E]?), cache HBM (in, out), (exponents HBM (in, out)?),
    # chunk buffer, (exponent buffer?), semaphores
    block: int,
    page_size: int,
    chunk: int,
    fp8: bool,
):
    if fp8:
        exps_ref, _, _, cache, exp_cache, buf, ebuf, sems = rest
    else:
        (_, cache, buf, sems), exps_ref, exp_cache, ebuf = rest, None, None, None
    b = pl.program_id(0)
    slot = [slots_ref[b * block + i] for i in range(block)]
    valid = [s >= 0 for s in slot]
    page = [jax.lax.div(jnp.maximum(s, 0), page_size) for s in slot]
    offset = [jax.lax.rem(jnp.maximum(s, 0), page_size) for s in slot]
    start = [pl.multiple_of(jax.lax.div(o, chunk) * chunk, chunk) for o in offset]
    key = [jax.lax.div(jnp.maximum(s, 0), chunk) for s in slot]  # the chunk's global id

    def value_copy(i: int, read: bool):
        hbm = cache.at[page[i], :, pl.ds(start[i], chunk)]
        src, dst = (hbm, buf.at[i]) if read else (buf.at[i], hbm)
        return pltpu.make_async_copy(src, dst, sems.at[0, i])

    def exp_copy(i: int, read: bool):
        hbm = exp_cache.at[:, page[i]]
        src, dst = (hbm, ebuf.at[i]) if read else (ebuf.at[i], hbm)
        return pltpu.make_async_copy(src, dst, sems.at[1, i])

    copies = [value_copy] + ([exp_copy] if fp8 else [])
    keys = [key] + ([page] if fp8 else [])

    def writer(i: int, keys_i) -> jax.Array:  # no later valid token in i's chunk (page)
        later = jnp.bool_(False)
        for j in range(i + 1, block):
            later = later | (valid[j] & (keys_i[j] == keys_i[i]))
        return valid[i] & jnp.logical_not(later)

    def read(i: int, wait: bool) -> None:
        @pl.when(valid[i])
        def _():
            for copy in copies:
                c = copy(i, read=True)
                c.wait() if wait else c.start()

    def merge(i: int, j: int, dst, new, width_axis: int, lanes) -> None:
        @pl.when(valid[j] & (keys_of(dst)[j] == keys_of(dst)[i]))
        def _():
            shape = dst.shape[1:]
            at = jax.lax.broadcasted_iota(jnp.int32, shape, width_axis)
            dst[i] = jnp.where(lanes(at, j), jnp.broadcast_to(new[j], shape), dst[i])

    def keys_of(dst):
        return key if dst is buf else page

    def write(i: int) -> None:
        @pl.when(writer(i, key))
        def _():
            for j in range(i + 1):  # the rows of the block's tokens in i's chunk
                merge(i, j, buf, rows_ref, 1, lambda at, j: at == offset[j] - start[j])
            value_copy(i, read=False).start()

        if fp8:

            @pl.when(writer(i, page))
            def _():
                for j in range(i + 1):  # K's and V's exponent lanes of the tokens in i's page
                    merge(i, j, ebuf, exps_ref, 2, exp_lanes)
                exp_copy(i, read=False).start()

    def exp_lanes(at, j: int):
        return (at == offset[j]) | (at == page_size + offset[j])

    def wait_written(i: int, copy, keys_c) -> None:
        @pl.when(writer(i, keys_c))
        def _():
            copy(i, read=False).wait()

    for wait in (False, True):  # all reads in flight, then all landed
        for i in range(block):
            read(i, wait)
    for i in range(block):
        write(i)
    for i in range(block):
        for copy, keys_c in zip(copies, keys, strict=True):
            wait_written(i, copy, keys_c)


def update_kv_cache(
    kv_cache: jax.Array | Fp8KVCache,  # [P, Hkv, page_size, W] (`tpu_layout`)
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    slot_mapping: jax.Array,  # i32[T] page*page_size + offset; < 0 for padding tokens
    *,
    interpret: Interpret = False,
    block: int = BLOCK,
) -> jax.Array | Fp8KVCache:
    """`tpu_layout.update_kv_cache` as an in-place kernel (see the module docstring); `block`
    tokens per program."""
    fp8 = isinstance(kv_cache, Fp8KVCache)
    if 2 * k.shape[-1] != kv_cache.shape[3]:
        raise ValueError(
            f"K/V of head_dim {k.shape[-1]} do not fill the cache's {kv_cache.shape[3]}-lane rows"
        )
    data = kv_cache.data if fp8 else kv_cache
    _, hkv, page_size, width = data.shape
    t = k.shape[0]
    padded = -(-t // block) * block
    slots = jnp.full((padded,), -1, jnp.int32).at[:t].set(slot_mapping.astype(jnp.int32))
    if fp8:
        q, exponent = quantize_kv_rows(jnp.stack([k, v], axis=2))  # [T, Hkv, 2, D], [T, Hkv, 2]
        rows = jnp.concatenate([q[:, :, 0], q[:, :, 1]], axis=-1)
        e_width = kv_cache.exponent.shape[-1]
        lane = jnp.arange(e_width)[None, None, :]
        offset = (jnp.maximum(slot_mapping, 0) % page_size)[:, None, None]
        e = exponent.astype(jnp.int32)
        exps = jnp.where(
            lane == offset, e[:, :, :1], jnp.where(lane == page_size + offset, e[:, :, 1:], 0)
        )
        extra = [_pad(exps[:, :, None, :], padded)]
    else:
        rows = jnp.concatenate([k, v], axis=-1).astype(data.dtype)
        extra = []
    chunk = chunk_rows(page_size)
    row_spec = pl.BlockSpec((block, hkv, 1, width), lambda b, s: (b, 0, 0, 0))
    hbm = pl.BlockSpec(memory_space=pltpu.HBM)
    exp_spec = [
        pl.BlockSpec((block, hkv, 1, x.shape[-1]), lambda b, s: (b, 0, 0, 0)) for x in extra
    ]
    caches = [data] + ([kv_cache.exponent] if fp8 else [])
    # NOTE: the operands' own memory space (not the BlockSpec's) is what XLA sees: unconstrained,
    # its memory-space assignment moved a small layer cache whole into VMEM around the call
    caches = [pltpu.with_memory_space_constraint(c, pltpu.HBM) for c in caches]
    scratch = [pltpu.VMEM((block, hkv, chunk, width), data.dtype)]
    if fp8:
        scratch.append(pltpu.VMEM((block, hkv, 1, kv_cache.exponent.shape[-1]), jnp.int32))
    moved = hkv * chunk * width * data.dtype.itemsize  # per token, each way
    if fp8:
        moved += hkv * kv_cache.exponent.shape[-1] * 4
    n_in = 1 + len(extra)
    out = pl.pallas_call(
        functools.partial(_kernel, block=block, page_size=page_size, chunk=chunk, fp8=fp8),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(padded // block,),
            in_specs=[row_spec, *exp_spec] + [hbm] * len(caches),
            out_specs=[hbm] * len(caches),
            scratch_shapes=[*scratch, pltpu.SemaphoreType.DMA((2, block))],
        ),
        out_shape=[jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches],
        input_output_aliases={1 + n_in + i: i for i in range(len(caches))},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        cost_estimate=pl.CostEstimate(
            flops=0,
            transcendentals=0,
            bytes_accessed=2 * t * moved + sum(x.size * x.dtype.itemsize for x in [rows, *extra]),
        ),
        interpret=interpret,
    )(slots, _pad(rows[:, :, None, :], padded), *extra, *caches)
    # NOTE: XLA gives the HBM-constrained output its own memory space annotation; returned as it
    # is from a program that donates the cache, XLA's verifier refused the alias (its output
    # space differs from the parameter's). The barrier keeps the program output a separate value.
    out = jax.lax.optimization_barrier(out)
    return Fp8KVCache(*out) if fp8 else out[0]


def _pad(x: jax.Array, n: int) -> jax.Array:
    return jnp.pad(x, [(0, n - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
