"""int4 codes in the CPU kernel's tiles (`reference.tile_int4`, `QArray.tiled`).

1. The tile order: element (k, n) lands where `tile_int4` says (a 1 KB tile is one 32-row block's
   64-column strip, rows in order), `untile_int4` inverts it (numpy and jnp alike).
2. The kernel's integer products on tiled codes give the same bits as on [K, N] codes (several
   weights a call, 1-8 rows, groups of 32 and 128) and match the exact integer emulation. On a CPU
   with AVX-512 VNNI (`int4_path()`), a process forced onto the AVX2 path
   (`JAXINFER_CPU_INT4_AVX2`) gives the same bits as the VNNI one, tiled and not.
3. Refusals name the problem: N not a multiple of 64, tiled codes without offsets, in Python and in
   the handler.
4. `quantization.tile_for_cpu` tiles exactly the int4 weights that fit; `layers.dense` on a tiled
   weight: the kernel with `tiled = true` up to `MAX_ROWS_INT4` rows (same bits as untiled), beyond
   (prefill chunks) XLA's dot on the weight `cpu.dequantize` wrote out (the same bits as XLA's
   whole path). `cpu.dequantize` itself: the bits of `reference.dequantize_offsets` (and so of
   XLA's dequantization), tiled or not, any N even, weights split over parts; refusals.
5. An `LLM` with `linear_backend="cpu"` runs on tiled int4 params and keeps one copy of the weights
   (its model's params are the runner's). test_cpu_linear's engine test gives the greedy tokens of
   `"xla"` with the runner's int4 params tiled.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import layers, quantization
from jaxinfer.quantization import QArray
from pallas_kernels.linear import cpu as cpu_linear
from pallas_kernels.linear import reference as linear_reference
from tests.test_cpu_linear import _int4_weight

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu" or not cpu_linear.available(),
    reason="the CPU linear kernel needs a CPU platform with AVX2 + FMA or AVX-512",
)

TOL = 1e-5  # of max |reference|


def test_tile_order_is_the_kernels():
    k, n = 64, 128
    codes = np.arange(k * n).reshape(k, n)  # distinct values: where each element went
    tiled = linear_reference.tile_int4(codes).reshape(-1)
    for kk, nn in [(0, 0), (1, 0), (0, 1), (2, 17), (33, 64), (63, 127), (40, 90)]:
        b, row, s, col = kk // 32, kk % 32, nn // 64, nn % 64
        assert tiled[((b * (n // 64) + s) * 32 + row) * 64 + col] == codes[kk, nn]
    # A tile (1 KB: 64 codes of each of 32 rows) holds one block's strip, rows in order.
    np.testing.assert_array_equal(tiled[:2048].reshape(32, 64), codes[:32, :64])
    np.testing.assert_array_equal(tiled[2048:4096].reshape(32, 64), codes[:32, 64:])
    for xp in (np, jnp):
        c = xp.asarray(np.random.default_rng(0).integers(0, 16, (96, 192)))
        back = linear_reference.untile_int4(linear_reference.tile_int4(c))
        np.testing.assert_array_equal(np.asarray(back), np.asarray(c))
    assert linear_reference.tiles_fit(576, 3072) and linear_reference.tiles_fit(1536, 576)
    assert not linear_reference.tiles_fit(576, 96) and not linear_reference.tiles_fit(48, 64)


@pytest.mark.parametrize("t", [1, 3, 8, 32])
@pytest.mark.parametrize(
    "k,ns,gs",
    [
        (576, (3072, 960), (18, 18)),  # SmolLM2's gate_up and qkv, Q4_1 blocks of 32
        (1536, (576,), (12,)),  # down, groups of 128 (GPTQ / AWQ)
        (64, (128, 64), (1, 2)),
    ],
)
def test_tiled_products_same_bits_as_rows(t, k, ns, gs):
    rng = np.random.default_rng(t * 100 + k)
    ws = [_int4_weight(rng, k, n, g) for n, g in zip(ns, gs)]
    x = jnp.asarray(rng.standard_normal((t, k), dtype=np.float32))
    kw = dict(
        scales=tuple(jnp.asarray(s) for _, s, _ in ws),
        offsets=tuple(jnp.asarray(o) for _, _, o in ws),
    )
    rows = [jnp.asarray(c, jnp.uint4) for c, _, _ in ws]
    tiles = [jnp.asarray(linear_reference.tile_int4(c), jnp.uint4) for c, _, _ in ws]
    want = cpu_linear.linear(x, *rows, **kw)
    got = cpu_linear.linear(x, *tiles, **kw, tiled=True)
    emulated = linear_reference.linear_offsets(x, *rows, **kw)
    for g, w, e in zip(got, want, emulated):
        assert np.asarray(g).tobytes() == np.asarray(w).tobytes()
        np.testing.assert_allclose(g, e, rtol=0, atol=TOL * float(jnp.abs(e).max()))


# Run in a child process (the path is chosen once per process): the products of `_path_cases`
# saved to the .npz named by argv[1], with the path that ran them.
_PATH_CHILD = """
import sys
import numpy as np
sys.path.insert(0, sys.argv[2])
from tests.test_cpu_linear_tiled import _path_cases
from pallas_kernels.linear import cpu
np.savez(sys.argv[1], path=cpu.int4_path(), **_path_cases())
"""


def _path_cases() -> dict[str, np.ndarray]:
    """Integer products of both layouts at 1, 4 and 32 rows: gate_up / qkv-shaped tiled weights, a
    [K, N] down with groups of 128, and a [K, N] weight with an N % 64 tail."""
    out = {}
    for t in (1, 4, 32):
        rng = np.random.default_rng(t)
        ws = [_int4_weight(rng, k, n, g) for k, n, g in ((576, 3072, 18), (576, 960, 18))]
        x = jnp.asarray(rng.standard_normal((t, 576), dtype=np.float32) * 3)
        kw = dict(
            scales=tuple(jnp.asarray(s) for _, s, _ in ws),
            offsets=tuple(jnp.asarray(o) for _, _, o in ws),
        )
        tiles = [jnp.asarray(linear_reference.tile_int4(c), jnp.uint4) for c, _, _ in ws]
        for i, y in enumerate(cpu_linear.linear(x, *tiles, **kw, tiled=True)):
            out[f"tiled{t}_{i}"] = np.asarray(y)
        for k, n, g in ((1536, 576, 12), (64, 130, 2)):
            c, s, o = _int4_weight(rng, k, n, g)
            xk = jnp.asarray(rng.standard_normal((t, k), dtype=np.float32))
            (y,) = cpu_linear.linear(
                xk, jnp.asarray(c, jnp.uint4), scales=(jnp.asarray(s),), offsets=(jnp.asarray(o),)
            )
            out[f"rows{t}_{k}x{n}"] = np.asarray(y)
    return out


@pytest.mark.skipif(
    cpu_linear.available() and cpu_linear.int4_path() != "avx512-vnni",
    reason="this CPU has no AVX-512 VNNI: the AVX2 path is the only one (tested above)",
)
def test_vnni_and_avx2_paths_give_the_same_bits(tmp_path):
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "JAXINFER_CPU_INT4_AVX2": "1", "JAX_PLATFORMS": "cpu"}
    out = tmp_path / "avx2.npz"
    subprocess.run(
        [sys.executable, "-c", _PATH_CHILD, str(out), root], env=env, check=True, timeout=300
    )
    avx2 = np.load(out)
    assert str(avx2["path"]) == "avx2"
    vnni = _path_cases()
    assert set(vnni) == set(avx2.files) - {"path"}
    for name, y in vnni.items():
        assert y.tobytes() == avx2[name].tobytes(), name


def test_tiled_products_refuse_what_they_cannot_take():
    rng = np.random.default_rng(1)
    c, s, o = _int4_weight(rng, 64, 96, 2)
    x, q = jnp.ones((1, 64), jnp.float32), jnp.asarray(c, jnp.uint4)
    with pytest.raises(
        ValueError, match=r"tiled weight 0 of shape \(64, 96\): N must be a multiple of 64"
    ):
        cpu_linear.linear(x, q, scales=(jnp.asarray(s),), offsets=(jnp.asarray(o),), tiled=True)
    with pytest.raises(ValueError, match="tiled int4 codes take the integer products only"):
        cpu_linear.linear(x, q, scales=(jnp.ones((2, 96)),), tiled=True)
    cpu_linear.library()  # the handler's own checks (a caller that skips `linear`'s)
    call = jax.ffi.ffi_call(cpu_linear.KERNEL.target, (jax.ShapeDtypeStruct((1, 96), jnp.float32),))
    attrs = dict(transposed=False, int8=True, offsets=True, tiled=True)
    with pytest.raises(Exception, match="tiled uint4 weights need N a multiple of 64, got 96"):
        jax.block_until_ready(call(x, q, jnp.asarray(s), jnp.asarray(o), **attrs))
    with pytest.raises(Exception, match="tiled codes take offsets calls only"):
        jax.block_until_ready(
            call(x, q, jnp.ones((2, 96), jnp.float32), **{**attrs, "offsets": False})
        )


def _qarray(rng, k: int, out: tuple[int, ...], g: int) -> QArray:
    n = int(np.prod(out))
    c, s, o = _int4_weight(rng, k, n, g)
    return QArray(
        jnp.asarray(c.reshape(k, *out), jnp.uint4),
        jnp.asarray(s.reshape(g, *out)),
        jnp.asarray(o.reshape(g, *out)),
    )


def test_tile_for_cpu_tiles_what_fits_and_dense_reads_it():
    rng = np.random.default_rng(2)
    params = {
        "qkv": _qarray(rng, 64, (2, 64), 2),  # [K, N] view [64, 128]: tiled
        "odd": _qarray(rng, 64, (96,), 2),  # N % 64: kept
        "small_groups": _qarray(rng, 64, (64,), 4),  # groups of 16 rows: kept
        "int8": QArray(jnp.ones((64, 64), jnp.int8), jnp.ones((1, 64), jnp.float32)),
        "norm": jnp.ones((64,)),
    }
    tiled = quantization.tile_for_cpu(params)
    assert [name for name, q in tiled.items() if getattr(q, "tiled", False)] == ["qkv"]
    w, t = params["qkv"], tiled["qkv"]
    assert t.shape == w.shape and t.data.dtype == jnp.uint4
    np.testing.assert_array_equal(np.asarray(quantization.codes(t)), np.asarray(w.data))
    assert quantization.tile_for_cpu(tiled)["qkv"].data is t.data  # once only
    for rows in (1, 3):  # decode rows: the kernel, tiled
        x = jnp.asarray(rng.standard_normal((rows, 64)), jnp.float32)
        text = jax.jit(lambda x, w: layers.dense(x, w, backend="cpu")).lower(x, t).as_text()
        assert "tiled = true" in text
        (got,), (want,) = layers.dense(x, t, backend="cpu"), layers.dense(x, w, backend="cpu")
        assert got.shape == (rows, 2, 64)
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
    x = jnp.asarray(rng.standard_normal((cpu_linear.MAX_ROWS_INT4, 64)), jnp.float32)
    assert (
        "tiled = true"
        in jax.jit(lambda x, w: layers.dense(x, w, backend="cpu")).lower(x, t).as_text()
    )
    # prefill rows: XLA's dot on the weight the kernel dequantized (untiling it), the values of
    # XLA's own dequantization
    x = jnp.asarray(rng.standard_normal((cpu_linear.MAX_ROWS_INT4 + 1, 64)), jnp.float32)
    text = jax.jit(lambda x, w: layers.dense(x, w, backend="cpu")).lower(x, t).as_text()
    assert cpu_linear.KERNEL.target not in text and cpu_linear.DEQUANTIZE_TARGET in text
    (got,), (want,) = layers.dense(x, t, backend="cpu"), layers.dense(x, w, backend="xla")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    (got,), (want,) = layers.dense(x, t, w, backend="cpu")[:1], layers.dense(x, w, backend="xla")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize(
    "k, n, g, tiled",
    [
        (64, 128, 2, True),
        (64, 128, 2, False),
        (64, 130, 2, False),  # N % 64 columns one by one
        (1536, 576, 48, True),  # SmolLM2's down: split into parts
        (576, 3072, 18, True),  # its gate_up
        (576, 960, 1, False),  # one group
    ],
)
def test_dequantize_gives_the_references_bits(k, n, g, tiled):
    rng = np.random.default_rng(k + n + g)
    c, s, o = _int4_weight(rng, k, n, g)
    codes, scales, offsets = jnp.asarray(c, jnp.uint4), jnp.asarray(s), jnp.asarray(o)
    want = np.asarray(linear_reference.dequantize_offsets(codes, scales, offsets))
    # the formula the model's XLA path uses (`checkpoints.quantize.dequantize`)
    np.testing.assert_array_equal(
        want, np.asarray(quantization.dequantize(QArray(codes, scales, offsets), 0))
    )
    stored = linear_reference.tile_int4(codes) if tiled else codes
    x = jnp.ones((3, k), jnp.float32)
    got = np.asarray(cpu_linear.dequantize(x, stored, scales, offsets, tiled=tiled))
    assert got.tobytes() == want.tobytes()


def test_dequantize_refuses_what_it_cannot_take():
    rng = np.random.default_rng(3)
    c, s, o = _int4_weight(rng, 64, 96, 2)
    x, q, s, o = (
        jnp.ones((2, 64), jnp.float32),
        jnp.asarray(c, jnp.uint4),
        jnp.asarray(s),
        jnp.asarray(o),
    )
    with pytest.raises(ValueError, match=r"tiled codes of shape \(64, 96\): N must be a multiple"):
        cpu_linear.dequantize(x, q, s, o, tiled=True)
    with pytest.raises(ValueError, match="scales"):
        cpu_linear.dequantize(x, q, s.astype(jnp.float32), o)
    cpu_linear.library()  # the handler's own checks (a caller that skips `dequantize`'s)
    call = jax.ffi.ffi_call(
        cpu_linear.DEQUANTIZE_TARGET, jax.ShapeDtypeStruct((64, 96), jnp.float32)
    )
    with pytest.raises(Exception, match="tiled codes need N a multiple of 64, got 96"):
        jax.block_until_ready(call(x, q, s, o, tiled=True))
    with pytest.raises(Exception, match="uint4 codes"):
        jax.block_until_ready(call(x, q.astype(jnp.uint8), s, o, tiled=False))
    with pytest.raises(Exception, match="offsets 0 must be f16"):
        jax.block_until_ready(call(x, q, s, o.astype(jnp.float32), tiled=False))
    with pytest.raises(Exception, match="offsets must have the scales' shape"):
        jax.block_until_ready(call(x, q, s, o[:1], tiled=False))


@pytest.mark.slow
def test_llm_runs_tiled_and_holds_one_copy(tmp_path):
    from jaxinfer import LLM, SamplingParams
    from tests.served_utils import tiny_model_dir

    llm = LLM(
        str(tiny_model_dir(tmp_path / "model")),
        load_format="dummy",
        quantization="int4",
        linear_backend="cpu",
        page_size=4,
        num_pages=16,
        max_model_len=32,
        max_num_seqs=1,
        max_num_batched_tokens=8,
    )
    assert llm.model.params is llm.engine.core.runner.params
    assert _tiled_flags(llm.model.params) and all(_tiled_flags(llm.model.params))
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def _tiled_flags(params) -> list[bool]:
    """`tiled` of every int4 linear weight (uint4 codes) of a params tree."""
    leaves = jax.tree.leaves(params, is_leaf=quantization.is_quantized)
    return [q.tiled for q in leaves if quantization.is_quantized(q) and q.data.dtype == jnp.uint4]
