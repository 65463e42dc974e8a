"""The one-launch GPU LoRA kernel (`pallas_kernels.lora.gpu`, issue 34) in Pallas interpret mode
equals the XLA formulation (`jaxinfer.lora.device.apply`): mixed slots with slot 0, 1 and 64
tokens, ranks 8 and 16 padded to the max rank, qkv's `[Hkv, G+2, D]` output and
the down projection reading the gate_up output through its activation. The Llama-3-8B shapes
compile for an H100 through Triton (deviceless, skipped without the CUDA plugin)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from jaxinfer import layers  # noqa: E402
from jaxinfer.lora import device as dev  # noqa: E402
from pallas_kernels.lora import gpu  # noqa: E402

# tiny model: E 64, Hq 4, Hkv 2 (G 2), D 16, F 128; 3 slots of max rank 16
E, HKV, G, D, F, N, R = 64, 2, 2, 16, 128, 3, 16


def _shapes(group: str, e: int, hkv: int, g: int, d: int, f: int, n: int, r: int):
    cfg = SimpleNamespace(
        hidden_size=e, intermediate_size=f, head_dim=d, num_heads=hkv * g, num_kv_heads=hkv
    )
    return dev.group_shapes(cfg, n, r)[group]


TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2 * float(jnp.finfo(jnp.bfloat16).eps)}


def _pair(rng, group: str, dtype) -> dev.LoRAPair:
    """Random stacks of `group`: slot 1 rank 8 (zero-padded to R), slot 2 empty, slot 3 rank 16."""
    a_shape, b_shape = _shapes(group, E, HKV, G, D, F, N, R)
    a = rng.normal(size=a_shape).astype(np.float32)
    b = rng.normal(size=b_shape).astype(np.float32)
    a[..., 0, 8:] = 0
    b[:, 0, 8:] = 0
    a[..., 1, :] = 0
    b[:, 1] = 0
    return dev.LoRAPair(jnp.asarray(a, dtype), jnp.asarray(b, dtype))


CASES = {  # group -> (x's trailing shape, y's trailing shape)
    "qkv": ((E,), (HKV, G + 2, D)),
    "o": ((HKV * G * D,), (E,)),
    "gate_up": ((E,), (2, F)),
    "down": ((2, F), (E,)),  # x: the gate_up output; the kernel applies silu(gate) * up
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("t", [1, 64])
def test_kernel_matches_xla(t, dtype):
    rng = np.random.default_rng(t)
    slots = jnp.asarray(np.arange(t) % (N + 1), jnp.int32)  # 0 (none), 1, 2 (empty), 3, ...
    for group, (x_shape, y_shape) in CASES.items():
        pair = _pair(rng, group, dtype)
        x = jnp.asarray(rng.normal(size=(t, *x_shape)), dtype)
        y = jnp.asarray(rng.normal(size=(t, *y_shape)), dtype)
        gated = group == "down"

        @jax.jit
        def run(pair, x, y, gated=gated):
            hidden = layers.activation("silu", x[:, 0]) * x[:, 1] if gated else x
            return dev.apply(pair, slots, hidden, y, "gpu", (x, "silu") if gated else None)

        got = np.asarray(run(pair, x, y), np.float32)
        pair32, x32, y32 = jax.tree.map(lambda v: v.astype(jnp.float32), (pair, x, y))
        if gated:
            x32 = layers.activation("silu", x32[:, 0]) * x32[:, 1]
        want = np.asarray(dev.apply(pair32, slots, x32, y32))
        scale = max(1.0, float(np.abs(want).max()))
        err = float(np.abs(got - want).max())
        assert err <= TOL[dtype] * scale, (group, t, err, scale)
        # slot 0 and the empty slot 2 add nothing; the others do
        none = np.asarray(slots) % 2 == 0
        np.testing.assert_array_equal(got[none], np.asarray(y, np.float32)[none])
        if t > 1:
            assert np.abs(got[~none] - np.asarray(y, np.float32)[~none]).max() > 1.0, group


@pytest.mark.parametrize("t", [1, 64])
def test_kernel_compiles_for_h100_llama3_8b(t):
    """bf16, Llama-3-8B (E 4096, F 14336, 32/8 heads), 4 slots of rank 16: one Triton launch per
    group; beyond one token also XLA's `y + delta` (in a step it fuses into y's consumer)."""
    from jaxinfer import aot

    if aot.available("gpu") is not None:
        pytest.skip(f"no deviceless gpu compiler: {aot.available('gpu')}")
    e, f, d, hq, hkv = 4096, 14336, 128, 32, 8
    g = hq // hkv
    ins = {"qkv": (e,), "o": (hq * d,), "gate_up": (e,), "down": (2, f)}
    outs = {"qkv": (hkv, g + 2, d), "o": (e,), "gate_up": (2, f), "down": (e,)}
    s = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.bfloat16)
    for group in dev.GROUPS:
        a_shape, b_shape = _shapes(group, e, hkv, g, d, f, 4, 16)
        gated = group == "down"

        def fn(a, b, slots, x, y, gated=gated):
            act = functools.partial(layers.activation, "silu") if gated else None
            return gpu.lora_apply(x, a, b, slots, y, gate_act=act)

        args = [s(a_shape), s(b_shape), jax.ShapeDtypeStruct((t,), jnp.int32)]
        args += [s((t, *ins[group])), s((t, *outs[group]))]
        text = aot.compile_function(fn, args, "h100").as_text()
        assert text.count('custom_call_target="__gpu$xla.gpu.triton"') == 1, group
        assert text.count(" fusion(") == (0 if t == 1 else 1), group
