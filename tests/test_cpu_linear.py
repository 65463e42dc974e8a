"""The compiled CPU linear kernel (`pallas_kernels.linear.cpu`) and its use by the model.

1. The kernel against numpy in float64: row counts 1-8, odd K and N (tails of the 16-lane
   vectors and of the 8-row passes), several weights in one call, the transposed ([N, K]) layout;
   int8 weights with group-wise scales (G = 1 per output channel, up to groups of 16 rows, a
   different G per weight of a call); results are bit-identical from call to call (partial sums
   are added in a fixed order).
   int4 codes with f16 scales and offsets (`offsets=`, activations quantized to 15 bits per 32
   channels) against the exact integer emulation (`reference.linear_offsets`) and the float64
   product within the activations' rounding bound; f16 scales of a transposed int8 weight.
2. Bad inputs (scale shapes, group sizes) raise naming the problem, in Python and in the handler.
3. `layers.dense` emits the custom call only where it pays (few float32 rows) and matches XLA's dot.
4. The model: logits with `linear_backend="cpu"` match `"xla"` over a prefill and decode steps, for
   an untied model and a tied one (LM head through the transposed layout); the engine gives the same
   greedy tokens with either backend; `resolve_linear_backend` picks and refuses as documented.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import layers
from jaxinfer.config import ModelConfig
from jaxinfer.models import llama
from jaxinfer.params import init_random
from pallas_kernels import cpu_build
from pallas_kernels.linear import cpu as cpu_linear
from pallas_kernels.linear import reference as linear_reference
from tests.model_utils import PagedStepper, hf_config_dict

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu" or not cpu_linear.available(),
    reason=f"the CPU linear kernel needs a CPU platform with AVX2 + FMA or AVX-512 ({cpu_linear.unavailable_reason()})"
    if jax.default_backend() == "cpu"
    else "not a CPU platform",
)

TOL = 1e-5  # of max |reference|


def _ref(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x.astype(np.float64) @ w.astype(np.float64)


@pytest.mark.parametrize("t", [1, 2, 3, 5, 8])
@pytest.mark.parametrize(
    "k,ns",
    [(7, (3,)), (64, (16, 32)), (100, (37, 1)), (576, (576, 384)), (1536, (576,)), (129, (1000,))],
)
def test_matches_numpy(t, k, ns):
    rng = np.random.default_rng(t * 1000 + k)
    x = rng.standard_normal((t, k), dtype=np.float32)
    ws = [rng.standard_normal((k, n), dtype=np.float32) for n in ns]
    outs = cpu_linear.linear(jnp.asarray(x), *map(jnp.asarray, ws))
    assert len(outs) == len(ws)
    for y, w in zip(outs, ws):
        ref = _ref(x, w)
        assert y.shape == ref.shape and y.dtype == jnp.float32
        np.testing.assert_allclose(y, ref, rtol=0, atol=TOL * np.abs(ref).max())
    (yt,) = cpu_linear.linear(jnp.asarray(x), jnp.asarray(ws[0].T.copy()), transposed=True)
    np.testing.assert_allclose(yt, _ref(x, ws[0]), rtol=0, atol=TOL * np.abs(_ref(x, ws[0])).max())


def _group_ref(x: np.ndarray, q: np.ndarray, s: np.ndarray) -> np.ndarray:
    """x [T, K] @ (q [K, N] * s [G, N] repeated over each group of K / G rows), in float64."""
    return _ref(
        x, q.astype(np.float64) * np.repeat(s.astype(np.float64), q.shape[0] // s.shape[0], axis=0)
    )


@pytest.mark.parametrize("t", [1, 2, 5, 8])
@pytest.mark.parametrize(
    "k,ns,gs",
    [
        (7, (3,), (1,)),
        (100, (37, 1), (1, 1)),
        (129, (1000,), (1,)),  # G = 1: any K
        (576, (576, 384), (18, 1)),  # groups of 32 (parts of 72 rows cut through groups) and G = 1
        (1536, (576,), (12,)),  # groups of 128
        (576, (1536, 1536, 33), (9, 36, 4)),  # groups of 64, 16 and 144; odd N
        (64, (33, 17), (4, 2)),
    ],
)
def test_int8_weights_match_numpy(t, k, ns, gs):
    """int8 weights with scales [G, N] (nk: [N, G]): x @ (q * s over groups), several weights per call."""
    rng = np.random.default_rng(t * 1000 + k)
    x = rng.standard_normal((t, k), dtype=np.float32)
    qs = [rng.integers(-127, 128, (k, n)).astype(np.int8) for n in ns]
    ss = [rng.uniform(1e-3, 2e-2, (g, n)).astype(np.float32) for n, g in zip(ns, gs)]
    outs = cpu_linear.linear(
        jnp.asarray(x), *map(jnp.asarray, qs), scales=tuple(map(jnp.asarray, ss))
    )
    outs_t = cpu_linear.linear(
        jnp.asarray(x),
        *(jnp.asarray(q.T.copy()) for q in qs),
        transposed=True,
        scales=tuple(jnp.asarray(s.T.copy()) for s in ss),
    )
    for y, yt, q, s in zip(outs, outs_t, qs, ss, strict=True):
        ref = _group_ref(x, q, s)
        assert y.shape == yt.shape == ref.shape
        np.testing.assert_allclose(y, ref, rtol=0, atol=TOL * np.abs(ref).max())
        np.testing.assert_allclose(yt, ref, rtol=0, atol=TOL * np.abs(ref).max())


@pytest.mark.parametrize("t", [1, 3, 8])
@pytest.mark.parametrize(
    "k,ns,gs",
    [
        (7, (6,), (1,)),  # rows past the last 8-row block; a tail of 6 codes (3 bytes)
        (100, (38, 2), (1, 1)),
        (576, (576, 1000), (18, 1)),  # groups of 32 (GGUF Q4), parts cut through them; tails
        (1536, (576,), (12,)),  # groups of 128 (int4's default)
    ],
)
def test_int4_codes_match_numpy(t, k, ns, gs):
    """uint4 codes [K, N] (packed two per byte by XLA, unpacked in registers) with scales [G, N],
    and an int8 weight in the same call (each weight read in its own bits)."""
    rng = np.random.default_rng(t * 1000 + k + 4)
    x = rng.standard_normal((t, k), dtype=np.float32)
    qs = [rng.integers(0, 16, (k, n)).astype(np.uint8) for n in ns]
    ss = [rng.uniform(1e-3, 2e-2, (g, n)).astype(np.float32) for n, g in zip(ns, gs)]
    q8 = rng.integers(-127, 128, (k, 10)).astype(np.int8)
    s8 = rng.uniform(1e-3, 2e-2, (gs[0], 10)).astype(np.float32)
    outs = cpu_linear.linear(
        jnp.asarray(x),
        *(jnp.asarray(q, jnp.uint4) for q in qs),
        jnp.asarray(q8),
        scales=(*map(jnp.asarray, ss), jnp.asarray(s8)),
    )
    for y, q, s in zip(outs, [*qs, q8], [*ss, s8], strict=True):
        ref = _group_ref(x, q, s)
        assert y.shape == ref.shape
        np.testing.assert_allclose(y, ref, rtol=0, atol=TOL * np.abs(ref).max())


def _int4_weight(rng, k: int, n: int, g: int):
    codes = rng.integers(0, 16, (k, n)).astype(np.uint8)
    scale = rng.uniform(1e-3, 2e-2, (g, n)).astype(np.float16)
    offset = rng.uniform(-0.1, 0.1, (g, n)).astype(np.float16)
    return codes, scale, offset


@pytest.mark.parametrize("t", [1, 3, 8])
@pytest.mark.parametrize(
    "k,ns,gs",
    [
        (576, (3072, 960), (18, 18)),  # GGUF Q4_1 blocks of 32: gate_up and qkv of SmolLM2
        (1536, (576,), (12,)),  # groups of 128 (GPTQ / AWQ)
        (64, (66, 2), (1, 2)),  # one group; N % 64 tails (2 columns, 1 byte a row)
    ],
)
def test_int4_integer_products_match_the_emulation_and_the_float_product(t, k, ns, gs):
    """`linear(..., offsets=)`: uint4 codes, f16 scales and offsets, x quantized to 15 bits per 32
    channels. Equal to `reference.linear_offsets` (the same integers) to f32 rounding, and to the
    float64 product x @ (codes * scale + offset) within the activations' rounding: per block b,
    |x - xq * xd| <= xd / 2, so |error[t, n]| <= sum_b xd[t, b] / 2 * sum_{k in b} |w[k, n]|."""
    rng = np.random.default_rng(t * 100 + k)
    x = rng.standard_normal((t, k), dtype=np.float32)
    ws = [_int4_weight(rng, k, n, g) for n, g in zip(ns, gs)]
    args = (
        jnp.asarray(x),
        *(jnp.asarray(c, jnp.uint4) for c, _, _ in ws),
    )
    kw = dict(
        scales=tuple(jnp.asarray(s) for _, s, _ in ws),
        offsets=tuple(jnp.asarray(o) for _, _, o in ws),
    )
    outs = cpu_linear.linear(*args, **kw)
    emulated = linear_reference.linear_offsets(*args, **kw)
    xd = np.asarray(linear_reference.quantize_x(jnp.asarray(x))[1], np.float64)  # [T, B]
    for y, e, (c, s, o) in zip(outs, emulated, ws, strict=True):
        assert y.shape == (t, c.shape[1]) and y.dtype == jnp.float32
        np.testing.assert_allclose(y, e, rtol=0, atol=TOL * float(np.abs(e).max()))
        w = c.astype(np.float64) * np.repeat(s.astype(np.float64), k // s.shape[0], 0)
        w += np.repeat(o.astype(np.float64), k // o.shape[0], 0)
        exact = x.astype(np.float64) @ w
        absw = np.abs(w).reshape(k // 32, 32, -1).sum(1)  # [B, N]
        bound = (xd / 2) @ absw + TOL * np.abs(exact).max()
        assert np.all(np.abs(np.asarray(y, np.float64) - exact) <= bound)
        assert np.abs(np.asarray(y) - exact).max() > 0  # the activations are rounded


def test_int4_integer_products_same_bits_with_or_without_helpers():
    """A call's parts do not depend on whether pool threads help (chosen per size class of call by
    measured cost, the other way tried for 4 calls in every 32): 33 calls of one shape take both
    ways and give the same bits."""
    rng = np.random.default_rng(3)
    c, s, o = _int4_weight(rng, 576, 3072, 18)
    x = jnp.asarray(rng.standard_normal((1, 576), dtype=np.float32))
    args = (x, jnp.asarray(c, jnp.uint4))
    kw = dict(scales=(jnp.asarray(s),), offsets=(jnp.asarray(o),))
    first = np.asarray(cpu_linear.linear(*args, **kw)[0])
    for _ in range(32):
        assert np.asarray(cpu_linear.linear(*args, **kw)[0]).tobytes() == first.tobytes()


def test_int4_integer_products_refuse_what_they_cannot_take():
    rng = np.random.default_rng(0)
    c, s, o = _int4_weight(rng, 64, 8, 2)
    x, q = jnp.ones((1, 64), jnp.float32), jnp.asarray(c, jnp.uint4)
    with pytest.raises(ValueError, match=r"scales 0 must be f16\[G, 8\].*float32"):
        cpu_linear.linear(x, q, scales=(jnp.asarray(s, jnp.float32),), offsets=(jnp.asarray(o),))
    with pytest.raises(ValueError, match=r"offsets 0 must be f16\[G, 8\] with K / G a multiple"):
        cpu_linear.linear(x, q, scales=(jnp.asarray(s),), offsets=(jnp.ones((4, 8), jnp.float16),))
    with pytest.raises(ValueError, match="K a multiple of 32"):
        cpu_linear.linear(x[:, :48], q[:48], scales=(s[:1],), offsets=(o[:1],))
    with pytest.raises(ValueError, match="weight 0 must be uint4"):
        cpu_linear.linear(
            x, q.astype(jnp.int8), scales=(jnp.asarray(s),), offsets=(jnp.asarray(o),)
        )
    assert cpu_linear.offsets_fit(576, 18) and cpu_linear.offsets_fit(1536, 12)
    assert not cpu_linear.offsets_fit(64, 4) and not cpu_linear.offsets_fit(48, 1)
    cpu_linear.library()  # the handler's own check (a caller that skips `linear`'s)
    call = jax.ffi.ffi_call(cpu_linear.KERNEL.target, (jax.ShapeDtypeStruct((1, 8), jnp.float32),))
    with pytest.raises(Exception, match=r"offsets 0 must be f16 \[G, 8\] with K / G a multiple"):
        jax.block_until_ready(
            call(
                x,
                q,
                jnp.asarray(s),
                jnp.ones((4, 8), jnp.float16),
                transposed=False,
                int8=True,
                offsets=True,
                tiled=False,
            )
        )


def test_transposed_int8_weights_take_f16_scales():
    """int4's tied embedding (int8 codes, f16 scales [V, G]) as LM head: the scales as stored."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 576), dtype=np.float32)
    q = rng.integers(-127, 128, (1000, 576)).astype(np.int8)
    s = rng.uniform(1e-3, 2e-2, (1000, 18)).astype(np.float16)
    (y,) = cpu_linear.linear(
        jnp.asarray(x), jnp.asarray(q), transposed=True, scales=(jnp.asarray(s),)
    )
    ref = _group_ref(x, q.T, s.T)
    np.testing.assert_allclose(y, ref, rtol=0, atol=TOL * np.abs(ref).max())


@pytest.mark.parametrize("g", [16, 32, 64, 144])
def test_transposed_int8_rows_same_bits_however_many_share_the_call(g):
    """A quantized LM head's rows of x are multiplied several at a time (each weight row widened
    once for all of them): every row's result has the bits of that row alone, for 1-32 rows
    (blocks of 8 / 4, pairs and a single one), f16 and f32 scales."""
    rng = np.random.default_rng(g)
    k = 576 if g != 144 else 288
    q = jnp.asarray(rng.integers(-127, 128, (300, k)), jnp.int8)
    x = rng.standard_normal((32, k), dtype=np.float32)
    for dtype in (np.float16, np.float32):
        s = jnp.asarray(rng.uniform(1e-3, 2e-2, (300, k // g)).astype(dtype))
        alone = [
            np.asarray(
                cpu_linear.linear(jnp.asarray(x[i : i + 1]), q, transposed=True, scales=(s,))[0]
            )
            for i in range(32)
        ]
        for t in (2, 3, 5, 8, 11, 17, 32):
            (y,) = cpu_linear.linear(jnp.asarray(x[:t]), q, transposed=True, scales=(s,))
            for i in range(t):
                assert np.asarray(y)[i].tobytes() == alone[i][0].tobytes(), (dtype, t, i)
        ref = _group_ref(x, np.asarray(q).T, np.asarray(s, np.float32).T)
        np.testing.assert_allclose(np.concatenate(alone), ref, rtol=0, atol=TOL * np.abs(ref).max())


def test_quantized_lm_head_takes_the_kernel_up_to_its_rows():
    """`layers.dense_transposed` on a quantized tied embedding: the kernel for up to
    `MAX_ROWS_HEAD` rows (XLA:CPU's product of a vocabulary-sized head is far slower), XLA's
    beyond; the same values either way."""
    from jaxinfer.quantization import QArray

    rng = np.random.default_rng(8)
    q = QArray(
        jnp.asarray(rng.integers(-127, 128, (512, 64)), jnp.int8),
        jnp.asarray(rng.uniform(1e-3, 2e-2, (512, 2)), jnp.float16),
    )
    for rows, kernel in [(cpu_linear.MAX_ROWS_HEAD, True), (cpu_linear.MAX_ROWS_HEAD + 1, False)]:
        x = jnp.asarray(rng.standard_normal((rows, 64)), jnp.float32)
        fn = lambda x, q: layers.dense_transposed(x, q, backend="cpu")  # noqa: E731
        assert _uses_kernel(fn, x, q) == kernel
        want = layers.dense_transposed(x, q, backend="xla")
        np.testing.assert_allclose(fn(x, q), want, rtol=0, atol=TOL * float(jnp.abs(want).max()))


@pytest.mark.parametrize("transposed", [False, True])
def test_reference_matches_numpy_and_the_kernel(transposed):
    """`linear.reference` (the oracle) against numpy in float64 and the kernel, f32 and int8."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 64), dtype=np.float32)
    w = rng.standard_normal((64, 40), dtype=np.float32)
    q = rng.integers(-127, 128, (64, 40)).astype(np.int8)
    s = rng.uniform(1e-3, 2e-2, (4, 40)).astype(np.float32)
    lay = (lambda a: a.T.copy()) if transposed else (lambda a: a)
    for args, scales, want in [
        ((w,), None, _ref(x, w)),
        ((q,), (s,), _group_ref(x, q, s)),
    ]:
        call = dict(transposed=transposed, scales=None if scales is None else (lay(scales[0]),))
        (ref,) = linear_reference.linear(jnp.asarray(x), jnp.asarray(lay(args[0])), **call)
        (got,) = cpu_linear.linear(jnp.asarray(x), jnp.asarray(lay(args[0])), **call)
        np.testing.assert_allclose(ref, want, rtol=0, atol=TOL * np.abs(want).max())
        np.testing.assert_allclose(got, ref, rtol=0, atol=TOL * np.abs(want).max())


def test_large_weights_split_over_threads_are_deterministic():
    """Big enough to be split into parts (K rows / N rows per thread): same bits every call."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 576), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal((576, 3072), dtype=np.float32))
    emb = jnp.asarray(rng.standard_normal((4099, 576), dtype=np.float32))
    first = [
        np.asarray(cpu_linear.linear(x, w)[0]),
        np.asarray(cpu_linear.linear(x, emb, transposed=True)[0]),
    ]
    for _ in range(5):
        again = [
            np.asarray(cpu_linear.linear(x, w)[0]),
            np.asarray(cpu_linear.linear(x, emb, transposed=True)[0]),
        ]
        assert all(a.tobytes() == b.tobytes() for a, b in zip(first, again))
    np.testing.assert_allclose(
        first[0], _ref(np.asarray(x), np.asarray(w)), rtol=0, atol=TOL * np.abs(first[0]).max()
    )
    np.testing.assert_allclose(
        first[1], _ref(np.asarray(x), np.asarray(emb).T), rtol=0, atol=TOL * np.abs(first[1]).max()
    )
    q = rng.integers(-127, 128, (576, 3072)).astype(np.int8)
    s = rng.uniform(1e-3, 2e-2, (18, 3072)).astype(np.float32)
    qe = rng.integers(-127, 128, (4099, 576)).astype(np.int8)
    se = rng.uniform(1e-3, 2e-2, (4099, 9)).astype(np.float32)

    def grouped():
        return [
            np.asarray(cpu_linear.linear(x, jnp.asarray(q), scales=(jnp.asarray(s),))[0]),
            np.asarray(
                cpu_linear.linear(x, jnp.asarray(qe), transposed=True, scales=(jnp.asarray(se),))[0]
            ),
        ]

    first = grouped()
    for _ in range(3):
        assert all(a.tobytes() == b.tobytes() for a, b in zip(first, grouped()))
    for got, want in zip(
        first, [_group_ref(np.asarray(x), q, s), _group_ref(np.asarray(x), qe.T, se.T)]
    ):
        np.testing.assert_allclose(got, want, rtol=0, atol=TOL * np.abs(want).max())


def test_bad_inputs_raise():
    x = jnp.ones((2, 8), jnp.float32)
    w = jnp.ones((8, 4), jnp.float32)
    with pytest.raises(ValueError, match="float32 weight 0.*bfloat16"):
        cpu_linear.linear(x, w.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="float32 x only.*bfloat16"):
        cpu_linear.linear(x.astype(jnp.bfloat16), w)
    with pytest.raises(ValueError, match="float32 weight 0 \\(no scales given\\), got int8"):
        cpu_linear.linear(x, w.astype(jnp.int8))
    with pytest.raises(ValueError, match="int8 or uint4 weight 0 \\(scales given\\), got float32"):
        cpu_linear.linear(x, w, scales=(jnp.ones((1, 4), jnp.float32),))
    with pytest.raises(
        ValueError, match="takes int8 weight 0 \\(scales given\\), transposed, got uint4"
    ):
        cpu_linear.linear(x, w.T.astype(jnp.uint4), transposed=True, scales=(jnp.ones((4, 1)),))
    with pytest.raises(
        ValueError, match=r"uint4 weight 0 of shape \(8, 3\): the kernel needs N even"
    ):
        cpu_linear.linear(x, jnp.ones((8, 3), jnp.uint4), scales=(jnp.ones((1, 3)),))
    with pytest.raises(ValueError, match="2 int8 weights need as many scale arrays, got 1"):
        cpu_linear.linear(
            x, w.astype(jnp.int8), w.astype(jnp.int8), scales=(jnp.ones((1, 4), jnp.float32),)
        )
    with pytest.raises(ValueError, match=r"scales 0 must be f32\[G, 4\].*bfloat16\[1, 4\]"):
        cpu_linear.linear(x, w.astype(jnp.int8), scales=(jnp.ones((1, 4), jnp.bfloat16),))
    assert (
        cpu_linear.groups_fit(64, 4)
        and cpu_linear.groups_fit(7, 1)
        and not cpu_linear.groups_fit(48, 2)
    )
    with pytest.raises(ValueError, match=r"weight 1 of shape \(9, 4\) does not fit x"):
        cpu_linear.linear(x, w, jnp.ones((9, 4), jnp.float32))
    with pytest.raises(ValueError, match="1 to 8 weights"):
        cpu_linear.linear(x)
    with pytest.raises(ValueError, match="1 to 8 weights"):
        cpu_linear.linear(x, *([w] * 9))
    with pytest.raises(ValueError, match=r"x must be \[T, K\]"):
        cpu_linear.linear(jnp.ones((8,), jnp.float32), w)
    assert (
        not cpu_linear.groups_fit(64, 3)
        and not cpu_linear.groups_fit(64, 0)
        and not cpu_linear.groups_fit(0, 2)
    )


@pytest.mark.parametrize(
    "k,w_shape,s_shape,transposed,match",
    [
        (
            8,
            (8, 4),
            (4,),
            False,
            r"scales 0 must be f32\[G, 4\] with G dividing K=8 .*float32\[4\]",
        ),
        (8, (8, 4), (1, 5), False, r"scales 0 must be f32\[G, 4\].*float32\[1, 5\]"),
        (8, (8, 4), (3, 4), False, r"G dividing K=8 .*float32\[3, 4\]"),
        (8, (8, 4), (0, 4), False, r"G dividing K=8"),
        (
            8,
            (4, 8),
            (1, 4),
            True,
            r"scales 0 must be f32\[4, G\] .*transposed=True.*float32\[1, 4\]",
        ),
        (
            48,
            (48, 4),
            (2, 4),
            False,
            r"group size K/G = 48/2 = 24 is not a positive multiple of 16",
        ),
        (48, (4, 48), (4, 6), True, r"group size K/G = 48/6 = 8 is not a positive multiple of 16"),
    ],
)
def test_bad_scales_raise(k, w_shape, s_shape, transposed, match):
    x = jnp.ones((2, k), jnp.float32)
    with pytest.raises(ValueError, match=match):
        cpu_linear.linear(
            x,
            jnp.ones(w_shape, jnp.int8),
            transposed=transposed,
            scales=(jnp.ones(s_shape, jnp.float32),),
        )


@pytest.mark.parametrize(
    "w_shape,s_shape,transposed,match",
    [
        (
            (48, 4),
            (2, 4),
            False,
            r"scales 0 of shape \[2, 4\] must be f32 \[G, N\] = \[G, 4\].*K = 48.*multiple of 16",
        ),
        ((48, 4), (4,), False, r"scales 0 of shape \[4\]"),
        ((4, 48), (4, 5), True, r"scales 0 of shape \[4, 5\] must be f32 \[N, G\] = \[4, G\]"),
    ],
)
def test_handler_rejects_bad_scales(w_shape, s_shape, transposed, match):
    """The C++ handler checks the scales itself (a caller that skips `linear`'s checks)."""
    cpu_linear.library()
    n = w_shape[0] if transposed else w_shape[1]
    call = jax.ffi.ffi_call(cpu_linear.KERNEL.target, (jax.ShapeDtypeStruct((1, n), jnp.float32),))
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(
            call(
                jnp.ones((1, 48), jnp.float32),
                jnp.ones(w_shape, jnp.int8),
                jnp.ones(s_shape, jnp.float32),
                transposed=transposed,
                int8=True,
                offsets=False,
                tiled=False,
            )
        )


def _uses_kernel(fn, *args) -> bool:
    return cpu_linear.KERNEL.target in jax.jit(fn).lower(*args).as_text()


def test_dense_picks_the_kernel_only_where_it_pays():
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((64, 2, 48), dtype=np.float32))
    for t, dtype, want in [
        (1, jnp.float32, True),
        (8, jnp.float32, True),
        (9, jnp.float32, False),
        (4, jnp.bfloat16, False),
    ]:
        x = jnp.asarray(rng.standard_normal((t, 64)), dtype)
        ww = w.astype(dtype)
        # float32 weights: only where the kernel beats XLA's dot on them (its AVX-512 build)
        want = want and cpu_linear.float_pays()
        assert _uses_kernel(lambda x, w: layers.dense(x, w, backend="cpu"), x, ww) == want, (
            t,
            dtype,
        )
        assert not _uses_kernel(lambda x, w: layers.dense(x, w, backend="xla"), x, ww)
        (got,) = layers.dense(x, ww, backend="cpu")
        want_y = jnp.einsum("te,ecf->tcf", x, ww)
        assert got.shape == (t, 2, 48)
        np.testing.assert_allclose(
            np.asarray(got, np.float32),
            np.asarray(want_y, np.float32),
            rtol=0,
            # f32 rows: the file's bar (summation order only); bf16 rounds x and w to 8 bits.
            atol=(1e-5 if dtype == jnp.float32 else 1e-2) * float(jnp.abs(want_y).max()),
        )
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    emb = jnp.asarray(rng.standard_normal((300, 64)), jnp.float32)
    assert (
        _uses_kernel(lambda x, e: layers.dense_transposed(x, e, backend="cpu"), x, emb)
        == cpu_linear.float_pays()
    )
    (want_t,) = linear_reference.linear(x, emb, transposed=True)
    np.testing.assert_allclose(
        layers.dense_transposed(x, emb, backend="cpu"),
        want_t,
        rtol=0,
        atol=TOL * float(jnp.abs(want_t).max()),
    )


def test_dense_int4_codes_in_the_kernel_offsets_in_xla():
    """`layers.dense` on an int4 `QArray` (fused output dims, f16 scales and offsets): the kernel
    takes codes times scales, XLA adds (x's group sums) @ offsets; equal to XLA's whole path."""
    from jaxinfer.quantization import QArray

    rng = np.random.default_rng(4)
    codes = jnp.asarray(rng.integers(0, 16, (64, 2, 48)), jnp.uint4)
    scale = jnp.asarray(rng.uniform(1e-2, 2e-1, (4, 2, 48)), jnp.float16)
    offset = jnp.asarray(rng.uniform(-1, 1, (4, 2, 48)), jnp.float16)
    w = QArray(codes, scale, offset)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    assert _uses_kernel(lambda x, w: layers.dense(x, w, backend="cpu"), x, w)
    (got,), (want,) = layers.dense(x, w, backend="cpu"), layers.dense(x, w, backend="xla")
    assert got.shape == want.shape == (3, 2, 48)
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL * float(jnp.abs(want).max()))


def test_dense_int4_groups_of_32_take_the_integer_products():
    """`layers.dense` hands int4 weights with groups of a multiple of 32 rows to the integer products
    (f16 scales and offsets as stored: no convert, no XLA offsets product), the qkv / gate_up
    layouts reshaped to [K, N]; equal to their emulation."""
    from jaxinfer.quantization import QArray

    rng = np.random.default_rng(5)
    codes, scale, offset = _int4_weight(rng, 64, 96, 2)
    w = QArray(
        jnp.asarray(codes.reshape(64, 2, 48), jnp.uint4),
        jnp.asarray(scale.reshape(2, 2, 48)),
        jnp.asarray(offset.reshape(2, 2, 48)),
    )
    x = jnp.asarray(rng.standard_normal((2, 64)), jnp.float32)
    text = jax.jit(lambda x, w: layers.dense(x, w, backend="cpu")).lower(x, w).as_text()
    assert cpu_linear.KERNEL.target in text and "offsets = true" in text
    assert "stablehlo.convert" not in text and "stablehlo.dot_general" not in text
    (got,) = layers.dense(x, w, backend="cpu")
    (want,) = linear_reference.linear_offsets(
        x,
        jnp.asarray(codes, jnp.uint4),
        scales=(jnp.asarray(scale),),
        offsets=(jnp.asarray(offset),),
    )
    assert got.shape == (2, 2, 48)
    np.testing.assert_allclose(
        got.reshape(2, 96), want, rtol=0, atol=TOL * float(jnp.abs(want).max())
    )


def test_lanes_name_the_build():
    avx512 = {"avx512f", "avx512bw", "avx512vl"} <= set(cpu_build.cpu_flags().split())
    assert cpu_linear.lanes() == (16 if avx512 else 8)
    assert cpu_linear.float_pays() == (cpu_linear.lanes() == 16)


def test_resolve_linear_backend():
    assert layers.resolve_linear_backend(None, "cpu") == "cpu"  # the kernel builds here
    assert layers.resolve_linear_backend("auto", "cpu") == "cpu"
    assert layers.resolve_linear_backend("auto", "gpu") == "gpu"  # layers.GPU_AUTO
    assert layers.resolve_linear_backend(None, "tpu") == "xla"
    assert layers.resolve_linear_backend("xla", "cpu") == "xla"
    with pytest.raises(ValueError, match="CPU platform only"):
        layers.resolve_linear_backend("cpu", "gpu")
    with pytest.raises(ValueError, match="linear_backend 'onednn' is not one of"):
        layers.resolve_linear_backend("onednn", "cpu")


def test_auto_falls_back_to_xla_when_the_kernel_cannot_build(monkeypatch, caplog):
    monkeypatch.setattr(cpu_linear, "unavailable_reason", lambda: "no C++ compiler found")
    with caplog.at_level("WARNING"):
        assert not layers._cpu_linear_builds.__wrapped__()
    assert "no C++ compiler found" in caplog.text and "using XLA's dot" in caplog.text
    monkeypatch.setattr(layers, "_cpu_linear_builds", lambda: False)
    assert layers.resolve_linear_backend("auto", "cpu") == "xla"


def _logits(monkeypatch, family: str, linear_backend: str) -> list[np.ndarray]:
    cfg = ModelConfig.from_hf(hf_config_dict(family))
    params = init_random(llama.param_specs(cfg), jax.random.PRNGKey(0))
    params = jax.tree.map(lambda x: x * 6.0, params)
    stepper = PagedStepper(params, cfg, page_size=4, num_pages=64, seed=1, min_tokens=8)
    # PagedStepper calls llama.forward_jit(params, cfg, step, caches)
    monkeypatch.setattr(
        llama,
        "forward_jit",
        jax.jit(
            lambda p, c, s, kv: llama.forward(p, c, s, kv, linear_backend=linear_backend),
            static_argnames=("c",),
        ),
    )
    out = [np.concatenate(stepper.step([(0, [3, 17, 101, 9, 44, 250, 7]), (1, [88, 2, 61])]))]
    tokens = [int(np.argmax(out[0][6])), int(np.argmax(out[0][-1]))]
    for _ in range(3):  # 2 decode rows, padded to 8: the kernel's few-row path
        last = stepper.step([(0, [tokens[0]]), (1, [tokens[1]])])
        out.append(np.concatenate(last))
        tokens = [int(np.argmax(x[-1])) for x in last]
    return out


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # untied LM head; tied (transposed) head
def test_model_logits_match_xla(monkeypatch, family):
    if not cpu_linear.float_pays():
        pytest.skip(
            "float32 weights stay on XLA's dot in the kernel's AVX2 build: nothing to compare"
        )
    want, got = _logits(monkeypatch, family, "xla"), _logits(monkeypatch, family, "cpu")
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * np.abs(w).max())


@pytest.mark.slow
def test_engine_same_tokens_with_either_backend():
    from tests import engine_utils as eu

    model = eu.tiny_model(eu.load_vocab())
    if not cpu_linear.float_pays():  # AVX2 build: the kernel takes quantized weights only
        from jaxinfer.quantization import quantize_params

        params = quantize_params(model.params, llama.param_specs(model.cfg), "int4")
        model = dataclasses.replace(model, params=params, quantization="int4")
    prompts = [[5, 300, 41, 7000, 12, 9], [88, 2, 61, 5, 190, 77, 1000, 3, 4]]
    outputs = {}
    for b in ("xla", "cpu"):
        engine, outputs[b] = eu.greedy_ids_on_backends(model, prompts, 8, linear_backend=b)
        assert engine.runner.linear_backend == b
        if model.quantization == "int4":  # the CPU runner's int4 codes in the kernel's tiles
            tiled = [q.tiled for q in _quantized(engine.runner.params) if q.data.dtype == jnp.uint4]
            assert tiled and all(tiled) == (b == "cpu"), (b, tiled)
    assert outputs["cpu"] == outputs["xla"]
    assert not any(q.tiled for q in _quantized(model.params))  # the caller's model as it was


def _quantized(params) -> list:
    from jaxinfer.quantization import is_quantized

    return [q for q in jax.tree.leaves(params, is_leaf=is_quantized) if is_quantized(q)]
