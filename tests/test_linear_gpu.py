"""The Pallas GPU dequantizing matmul (`pallas_kernels.linear.gpu`) against XLA's formulation.

Interpret mode on the CPU: int8 (grouped f32 scales) and int4 (uint4 codes, f16 scales and
offsets) weights, through `layers.dense` in the fused layouts the model hands it (qkv
[E, Hkv, G+2, D], gate_up [E, 2, F]), equal to `layers._xla_dense` (f32: 1e-5; bf16: within
bf16's eps: the f32 product of the bf16 inputs rounded once); every launch form (`Blocks`: K
splits, unrolled tiles, the one-row "fma" form) likewise. The launch configuration's choice
(`blocks`: the measured `TUNED` table by nearest row class, else `default_blocks`). Deviceless:
every configuration the table and the rule ship compiles through Pallas Triton for an H100 at
Llama-3-8B's and SmolLM2's projection shapes (skipped without the CUDA plugin).
"""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from checkpoints import quantize as qlib  # noqa: E402
from jaxinfer import layers  # noqa: E402
from jaxinfer.quantization import QArray  # noqa: E402
from pallas_kernels.linear import gpu as gpu_linear  # noqa: E402
from tests.script_utils import script  # noqa: E402

E, GROUPS = 256, 2  # 2 groups of 128 input channels (the int8 / int4 group size)
SHAPES = {"qkv": (2, 4, 16), "gate_up": (2, 48)}  # [Hkv, G+2, D], [2, F] after E


def _weight(fmt: str, out: tuple[int, ...], seed: int) -> QArray:
    w = np.random.default_rng(seed).standard_normal((E, *out)).astype(np.float32)
    if fmt == "int4":
        data, scale, offset = qlib.quantize4(w, 0, GROUPS)
        return QArray(jnp.asarray(data), jnp.asarray(scale), jnp.asarray(offset))
    data, scale = qlib.quantize(w, "int8", 0, GROUPS)
    return QArray(jnp.asarray(data), jnp.asarray(scale))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_interpreted_kernel_equals_xla_dense(fmt):
    weights = [_weight(fmt, shape, i) for i, shape in enumerate(SHAPES.values())]
    rng = np.random.default_rng(7)
    for t, dtype, part in ((1, jnp.float32, 0), (7, jnp.bfloat16, 1), (64, jnp.float32, 1)):
        w = weights[part]
        x = jnp.asarray(rng.standard_normal((t, E)), dtype)
        (y,) = layers.dense(x, w, backend="gpu")  # NOTE: interpreted: the target is the CPU
        # NOTE: XLA:CPU has no bf16 x bf16 -> f32 dot: the reference widens x (exact) and rounds
        # its f32 product to x's dtype, as the kernel does.
        want = layers._xla_dense(x.astype(jnp.float32), w).astype(dtype)
        assert y.shape == want.shape == (t, *w.shape[1:]) and y.dtype == x.dtype
        y, want = np.asarray(y, np.float32), np.asarray(want, np.float32)
        scale = float(np.abs(want).max())
        eps = 1e-5 if dtype == jnp.float32 else float(jnp.finfo(dtype).eps)
        np.testing.assert_allclose(y, want, rtol=eps, atol=eps * scale, err_msg=f"{fmt} t={t}")


def test_act_order_weights_read_x_through_their_permutation():
    """`layers.dense` on the gpu backend hands an act-order weight's `perm` to the kernel (no
    gathered copy of x); XLA's path (backend "xla", and rows the kernel refuses) gathers first.
    Both equal the product of the gathered x with the weight's stored rows."""
    rng = np.random.default_rng(3)
    for fmt in ("int8", "int4"):
        w = _weight(fmt, SHAPES["gate_up"], 5)
        w = w.replace(perm=jnp.asarray(rng.permutation(E), jnp.int32))
        for t in (1, 7, 65):  # 65 rows: XLA's product (the kernel takes <= 64)
            x = jnp.asarray(rng.standard_normal((t, E)), jnp.float32)
            want = layers._xla_dense(jnp.take(x, w.perm, axis=1), w.replace(perm=None))
            for backend in ("gpu", "xla"):
                (y,) = layers.dense(x, w, backend=backend)
                np.testing.assert_allclose(
                    y, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()), err_msg=backend
                )


def test_auto_picks_the_kernel_on_gpu():
    assert layers.resolve_linear_backend("auto", "gpu") == "gpu"  # layers.GPU_AUTO: measured
    assert layers.resolve_linear_backend("xla", "gpu") == "xla"
    assert layers.resolve_linear_backend("auto", "tpu") == "xla"
    assert layers.resolve_linear_backend("gpu", "cpu") == "gpu"  # interpreted there
    assert gpu_linear.supported(65, E, 64, GROUPS, jnp.int8)  # prefill rows: XLA's product
    assert gpu_linear.supported(1, E, 64, GROUPS, jnp.float8_e4m3fn)
    assert gpu_linear.supported(1, E, 64, GROUPS, jnp.uint4) is None


B = gpu_linear.Blocks


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize(
    "t,blocks",
    [
        (1, B(64, 2, 64, 2, "fma")),  # K split in 2 runs of 2-tile steps
        (1, B(32, 4, 128, 1, "fma")),
        (1, B(64, 2, 32, 4, "fma")),  # a group's 4 tiles summed, then scaled
        (1, B(32, 1, 16, 16, "fma")),  # two groups' windows a loop step
        (3, B(32, 2, 64, 2, "dot")),
        (1, B(64, 1, 32, 4, "dot")),
        (5, B(32, 4, 128, 1, "dot", 8, 2)),
    ],
)
def test_every_form_equals_xla_dense(fmt, t, blocks):
    e, n, groups = 512, 96, 4  # 3 column blocks of 32: the last program's columns clamped
    w = np.random.default_rng(0).standard_normal((e, n)).astype(np.float32)
    if fmt == "int4":
        data, scale, offset = qlib.quantize4(w, 0, groups)
        q = QArray(jnp.asarray(data), jnp.asarray(scale), jnp.asarray(offset))
    else:
        data, scale = qlib.quantize(w, "int8", 0, groups)
        q = QArray(jnp.asarray(data), jnp.asarray(scale))
    x = jnp.asarray(np.random.default_rng(t).standard_normal((t, e)), jnp.float32)
    want = np.asarray(layers._xla_dense(x, q))
    metas = [(q.scale, q.offset)]
    if fmt == "int4":  # f32 scales and offsets too: loaded a column at a time, not as f16 pairs
        metas.append((q.scale.astype(jnp.float32), q.offset.astype(jnp.float32)))
    for scale, offset in metas:
        y = gpu_linear.quantized_matmul(x, q.data, scale, offset, interpret=True, config=blocks)
        np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # act-order (GPTQ desc_act): code row k reads x's channel perm[k], gathered in the kernel
    perm = jnp.asarray(np.random.default_rng(1).permutation(e), jnp.int32)
    want = np.asarray(layers._xla_dense(jnp.take(x, perm, axis=1), q))
    y = gpu_linear.quantized_matmul(
        x, q.data, q.scale, q.offset, perm=perm, interpret=True, config=blocks
    )
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_blocks_come_from_the_table_by_nearest_row_class(monkeypatch):
    tuned = {
        ("int8", 512, 96, 1): B(32, 2, 64, 2, "fma"),
        ("int8", 512, 96, 32): B(64, 4, 128, 1, "dot"),
    }
    monkeypatch.setattr(gpu_linear, "TUNED", tuned)
    assert gpu_linear.blocks(1, 512, 96, 4, jnp.int8) == tuned[("int8", 512, 96, 1)]
    for t in (2, 16, 32, 64):  # "fma" takes one row: the 32-row entry is the nearest that runs
        assert gpu_linear.blocks(t, 512, 96, 4, jnp.int8) == tuned[("int8", 512, 96, 32)]
    # another shape, code type or group size: the rule
    assert gpu_linear.blocks(1, 512, 96, 4, jnp.uint4) == gpu_linear.default_blocks(
        1, 512, 96, 4, True
    )
    rule = gpu_linear.blocks(1, 512, 96, 16, jnp.int8)  # groups of 32: the table's tiles do not fit
    assert rule == gpu_linear.default_blocks(1, 512, 96, 16, False) and rule.block_k == 32
    gpu_linear.load_tuned(
        [{"codes": "uint4", "k": 512, "n": 96, "rows": 16, "blocks": B(32, 1, 64)._asdict()}]
    )
    assert gpu_linear.blocks(8, 512, 96, 4, jnp.uint4) == B(32, 1, 64)


def test_check_blocks_names_what_does_not_fit():
    check = gpu_linear.check_blocks
    assert check(B(128, 8, 64, 2, "fma"), 1, 4096, 6144, 32, jnp.uint4) is None
    assert "one row" in check(B(128, 8, 64, 2, "fma"), 2, 4096, 6144, 32, jnp.uint4)
    assert "group size 32" in check(B(128, 8, 64, 2, "dot"), 2, 4096, 6144, 128, jnp.int8)
    assert "split" in check(B(128, 64, 128, 1, "dot"), 2, 4096, 6144, 32, jnp.int8)
    assert ">= 32" in check(B(16, 1, 128), 2, 4096, 6144, 32, jnp.uint4)
    # "fma" scales a group's tiles at once: a loop step of 3 tiles of 2-tile groups cannot
    assert "align" in check(B(128, 1, 64, 3, "fma"), 1, 768, 6144, 6, jnp.uint4)
    assert check(B(128, 1, 64, 3, "dot"), 1, 768, 6144, 6, jnp.uint4) is None
    with pytest.raises(ValueError, match="one row"):
        gpu_linear.quantized_matmul(
            jnp.zeros((2, 256)), jnp.zeros((256, 64), jnp.int8), jnp.ones((2, 64)),
            config=B(32, 1, 128, 1, "fma"), interpret=True,
        )  # fmt: skip


def _shipped_configs():
    """(fmt, t, k, n, Blocks): every `TUNED` entry at its shape, and the rule at SmolLM2's
    projections (groups of 64: K = 576) and an 8B shape at 8 rows."""
    out = []
    for (codes, k, n, rows), b in gpu_linear.TUNED.items():
        out.append(("int4" if codes == "uint4" else "int8", rows, k, n, b))
    for fmt in ("int8", "int4"):
        for k, n, t in (
            (576, 960, 1),
            (576, 3072, 1),
            (1536, 576, 1),
            (576, 960, 8),
            (4096, 6144, 8),
        ):
            groups = k // (64 if k == 576 else 128)
            out.append((fmt, t, k, n, gpu_linear.default_blocks(t, k, n, groups, fmt == "int4")))
    return out


def test_every_shipped_configuration_compiles_for_h100():
    from jaxinfer import aot

    reason = aot.available("gpu")
    if reason is not None:
        pytest.skip(f"no deviceless gpu compiler: {reason}")
    s = jax.ShapeDtypeStruct
    for fmt, t, k, n, b in _shipped_configs():
        codes = jnp.int8 if fmt == "int8" else jnp.uint4
        meta = s((k // (64 if k == 576 else 128), n), jnp.dtype(qlib.SCALE_DTYPE[fmt]))
        args = (s((t, k), jnp.bfloat16), s((k, n), codes), meta) + ((meta,) * (fmt == "int4"))
        text = aot.compile_function(
            gpu_linear.quantized_matmul, args, "h100", static_kwargs={"config": b}
        ).as_text()
        assert text.count('custom_call_target="__gpu$xla.gpu.triton"') == 1, (fmt, t, k, n, b)


def _sass_script():
    """`scripts/kernel_sass.py` as a module."""
    return script("kernel_sass")


def _kernel_ptx(fmt: str, t: int, b, where) -> str:
    """The PTX of the kernel for x [t, 4096] times [4096, 6144] codes of `fmt` in groups of 128
    with blocks `b`, from the deviceless H100 compile (skips without the CUDA plugin)."""
    from jaxinfer import aot

    reason = aot.available("gpu")
    if reason is not None:
        pytest.skip(f"no deviceless gpu compiler: {reason}")
    where.mkdir(parents=True, exist_ok=True)
    return _sass_script().kernel_ptx(fmt, t, 4096, 6144, 32, b, where)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_codes_become_floats_without_conversion_instructions(fmt, tmp_path):
    """Integer-to-float conversions issue at a fraction of the FMA rate and bounded the kernel on
    an H200 (BENCHMARKS.md "The dequantizing matmul tuned"): the PTX of both forms has none (the
    "fma" form makes each code an f32 denormal with a `prmt`; the "dot" form hands Triton int8
    values, which it widens to bf16 with byte permutes)."""
    import re

    for t, b in ((1, B(128, 8, 64, 2, "fma")), (32, B(128, 8, 128, 1, "dot"))):
        kernel = _kernel_ptx(fmt, t, b, tmp_path / b.form)
        assert "mma.sync" in kernel or b.form == "fma"
        convs = re.findall(r"cvt\.rn\.(?:f32|f16|bf16)\.[us](?:8|16|32)\b", kernel)
        assert convs == [], (b, sorted(set(convs)), len(convs))
        if fmt == "int4":  # the nibbles split 4 bytes a register (`_NIBBLES`, `_ASM`)
            assert "0x0F0F0F0F" in kernel, b


def _run_ptx(asm: str, operands: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Runs one of the kernel's inline PTX blocks on uint32 arrays (the bits of each operand):
    the instructions `_ASM` uses, as the PTX ISA defines them (`fma.rn.f32` one rounding: the
    f32 product is exact in f64)."""
    regs = {f"${i}": v.astype(np.uint32) for i, v in operands.items()}
    f32 = lambda v: v.view(np.float32)  # noqa: E731
    bits = lambda v: np.asarray(v, np.float32).view(np.uint32)  # noqa: E731

    def val(tok):
        if tok in regs:
            return regs[tok]
        if tok.startswith("0f"):
            return np.uint32(int(tok[2:], 16))
        return np.uint32(int(tok, 0))

    body = asm.strip().removeprefix("{").removesuffix("}")
    for stmt in filter(None, (st.strip() for st in body.split(";"))):
        op, _, rest = stmt.partition(" ")
        args = [a.strip() for a in rest.split(",")]
        if op == ".reg":
            continue
        d, src = args[0], [val(a) for a in args[1:]]
        if op == "mov.b32":
            out = np.broadcast_to(src[0], next(iter(regs.values())).shape).copy()
        elif op == "and.b32":
            out = src[0] & src[1]
        elif op == "xor.b32":
            out = src[0] ^ src[1]
        elif op == "shr.u32":
            out = src[0] >> src[1]
        elif op == "prmt.b32":  # result byte i: byte (sel >> 4i) & 7 of {b, a}
            a, b, sel = src[0], src[1], int(src[2])
            pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [
                (b >> (8 * i)) & 0xFF for i in range(4)
            ]
            out = sum(pool[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))
        elif op == "fma.rn.f32":
            wide = f32(src[0]).astype(np.float64) * f32(src[1]) + f32(src[2])
            out = bits(wide.astype(np.float32))
        else:
            raise AssertionError(f"instruction {op} is not emulated")
        regs[d] = np.asarray(out, np.uint32)
    return {int(k[1:]): v for k, v in regs.items() if k.startswith("$")}


@pytest.mark.parametrize("kind", ["lo", "hi", "int8"])
def test_inline_ptx_adds_x_times_each_code(kind):
    """The PTX the "fma" form runs on a GPU (interpreted, the CPU runs its jnp twin): for 4
    packed code bytes (Triton puts element j in byte j) and x' = x * 2**X_SHIFT, $j = $(9+j) +
    x_j * code_j * 2**-SUM_SHIFT with one rounding, for every byte value (int8: code + 128), the
    code a denormal."""
    rng = np.random.default_rng(3)
    n = 4096
    codes = rng.integers(0, 256, (n, 4), dtype=np.uint32)
    packed = codes[:, 0] | codes[:, 1] << 8 | codes[:, 2] << 16 | codes[:, 3] << 24
    x = rng.standard_normal((4, n)).astype(np.float32) * np.float32(2.0**-30)
    x[:, :8] = np.float32(2.0**40)  # large and small activations
    acc = (rng.standard_normal((4, n)) * 10 * 2.0**-gpu_linear.SUM_SHIFT).astype(np.float32)
    xs = x * np.float32(2.0**gpu_linear.X_SHIFT)
    ops = {4: packed} | {5 + j: xs[j].view(np.uint32) for j in range(4)}
    ops |= {9 + j: acc[j].view(np.uint32) for j in range(4)}
    out = _run_ptx(gpu_linear._ASM[kind], ops)
    value = {"lo": codes & 15, "hi": codes >> 4, "int8": codes.astype(np.uint8) ^ 0x80}
    for j in range(4):
        c = value[kind][:, j].astype(np.float64)
        exact = acc[j].astype(np.float64) + x[j].astype(np.float64) * c * 2.0**-gpu_linear.SUM_SHIFT
        np.testing.assert_array_equal(out[j].view(np.float32), exact.astype(np.float32))


def test_inline_ptx_splits_nibbles_four_bytes_at_a_time():
    """The "dot" form's int4 nibbles on a GPU (`_NIBBLES`): the low and the high nibble of each
    of the 4 packed bytes, in its byte."""
    packed = np.random.default_rng(5).integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32)
    b = packed.view(np.uint8).reshape(-1, 4)
    for asm, want in zip(gpu_linear._NIBBLES, (b & 15, b >> 4)):
        out = _run_ptx(asm, {1: packed})[0]
        np.testing.assert_array_equal(out.view(np.uint8).reshape(-1, 4), want)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_fma_form_spends_few_instructions_a_code(fmt, tmp_path):
    """The one-row form's PTX (deviceless H100 compile): one `prmt` and one `fma` a code (its
    inline blocks: no subtraction, no conversion), every product an FMA (no `mul.rn.f32`), and
    int4's f16 scales and offsets converted once per column and group a thread holds, not per
    code. The old body spent 9.3 (int4) / 7.6 (int8) SASS instructions a code, this one 3-4
    (BENCHMARKS.md "The one-row dequantizing matmul in fewer instructions")."""
    import re

    b = B(128, 8, 64, 2, "fma", 4, 3)
    ptx = _kernel_ptx(fmt, 1, b, tmp_path)
    count = lambda op: len(re.findall(rf"\b{re.escape(op)}\b", ptx))  # noqa: E731
    per_thread = gpu_linear.codes_per_thread(b)  # 2 tiles of 64 rows x 128 codes, 128 threads
    assert per_thread == 128
    assert count("prmt.b32") == per_thread and count("sub.f32") == 0
    # products are FMAs; the few multiplies scale x (a row, not a code)
    assert count("mul.rn.f32") < per_thread // 2 and count("fma.rn.f32") >= per_thread
    if fmt == "int4":
        assert 0 < count("cvt.f32.f16") <= per_thread // 2, count("cvt.f32.f16")


def test_sass_script_counts_each_loop():
    """`scripts/kernel_sass.py` (the instruction counts above, from nvdisasm's text): a loop is
    the instructions from a label to a branch back to it; predicated and modified opcodes count
    under their name. (Its codes a thread: `gpu.codes_per_thread`, checked above.)"""
    sass = _sass_script()
    text = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   PRMT R4, R2, 0x4440, RZ ;
        /*0020*/                   FFMA R5, R3, R4, R5 ;
        /*0030*/                   FFMA.FTZ R6, R3, R4, R6 ;
        /*0040*/              @!P0 BRA `(.L_x_0) ;
        /*0050*/                   BRA `(.L_x_1) ;
.L_x_1:
        /*0060*/                   EXIT ;
"""
    [loop] = sass.loops(text)
    assert loop == {"PRMT": 1, "FFMA": 2, "BRA": 1}
