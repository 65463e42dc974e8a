"""DeepSeek-V2 / V3: multi-head latent attention (MLA) and fine-grained MoE with shared experts.

1. `param_specs(cfg, dtype, quantization)` declares every weight once. MLA keeps the checkpoint's
   low-rank projections: `q` (or `q_a` -> norm -> `q_b` with `q_lora_rank`), `kv_a` (hidden ->
   latent L + rope key R), and splits `kv_b_proj` at load into `w_uk [H, Dn, L]` and
   `w_uv [H, L, Dv]`, stored in the layouts their contractions want. With `quantization` the
   projections, MLPs, experts, embedding and LM head are `QArray`s (as in `llama.param_specs`);
   `w_uk` / `w_uv` (absorbed by einsum), norms and the router stay in the model dtype.
   The latent cache is kept in the model dtype: `kv_cache_dtype='fp8'` is refused.
2. `params_from_hf` maps HF tensor names onto that tree (`hf_weights.fill_params`). Where the
   checkpoint lays rotary dims out as (x0, x1) pairs (`cfg.rope_interleave`), the rope columns of
   `q`/`q_b` and `kv_a` are permuted at load to (evens | odds), so the shared half-split RoPE gives
   the same dot products. Multi-token-prediction layers (`num_nextn_predict_layers`) are skipped.
3. `forward(params, cfg, step, kv_caches)`: embed -> layers -> final norm -> logits at
   `step.logits_indices`. Per layer:
   a. attention (`_mla_block`): q_nope, q_rope from the query projection; latent and rope key from
      `kv_a`; RoPE on q_rope and the key; `W_uk` absorbed into the query (q_lat = q_nope W_uk);
      the cache row `[norm(latent) | k_rope]` is written and attended with
      `[q_lat | q_rope]` by `jaxinfer.mla_attention` (values = cached latents); the latent output
      is lifted by `W_uv` and projected by `o`. Only (L + R) values per token and layer are cached.
   b. MLP: the first `first_k_dense_replace` layers are dense gated MLPs; the rest are `moe.moe_mlp`
      (softmax / sigmoid + correction bias, group-limited top-k, routed scaling) plus the shared
      experts (one gated MLP), summed before the one all-reduce.
4. On a mesh, through `sharded.forward` as `llama.forward`: one `shard_map`; heads (q, w_uk, w_uv, o), the dense MLPs, the
   shared experts and the vocab split over `sharding.dense_axes`, experts over `expert` with their
   F over `tensor`; `kv_a` is replicated and so is the latent cache (every head shard reads every
   row), pages split over `data`. Pipeline meshes are refused (layers differ in kind).

Einsum legend: t = token, h = head, n = qk_nope_head_dim, l = kv_lora_rank (latent),
v = v_head_dim.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, PartitionSpec

from jaxinfer import layers, moe
from jaxinfer import mla_attention as mla
from jaxinfer.config import ModelConfig
from jaxinfer.models import llama, sharded
from jaxinfer.models.hf_weights import IGNORED, fill_params, ident, moe_expert_names, transpose
from jaxinfer.models.llama import MLPParams, Params
from jaxinfer.models.sharded import SINGLE, Kernels
from jaxinfer.moe import MoEParams
from jaxinfer.params import ParamSpec
from jaxinfer.quantization import quantize_specs
from jaxinfer.sharding import DATA, EXPERT, TENSOR, Parallel
from jaxinfer.step import StepInputs

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@struct.dataclass
class MLAParams:
    kv_a: Any  # [E, L + R]  latent and rope-key projections fused (kv_a_proj_with_mqa)
    kv_a_norm: Any  # [L]
    w_uk: Any  # [H, Dn, L]  kv_b_proj's key half: absorbed into the query
    w_uv: Any  # [H, L, Dv]  kv_b_proj's value half: applied to the latent output
    o: Any  # [H*Dv, E]
    q: Any = None  # [E, H*(Dn+R)]  without q_lora_rank
    q_a: Any = None  # [E, Lq]
    q_a_norm: Any = None  # [Lq]
    q_b: Any = None  # [Lq, H*(Dn+R)]


@struct.dataclass
class LayerParams:
    attn_norm: Any  # [E]
    attn: MLAParams
    mlp_norm: Any  # [E]
    mlp: MLPParams | MoEParams
    shared: MLPParams | None = None  # the shared experts of a MoE layer, as one gated MLP


def param_specs(
    cfg: ModelConfig, dtype: Any = jnp.float32, quantization: str | None = None
) -> Params:
    """Every weight declared once: shape, dtype, logical axes, init; with `quantization` ("int8" |
    "fp8") the weights read through `layers.dense` / the experts are `QArray`s."""
    e, h, v = cfg.hidden_size, cfg.num_heads, cfg.vocab_size
    dn, r, lat, dv, lq = (
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.kv_lora_rank,
        cfg.v_head_dim,
        cfg.q_lora_rank,
    )

    def w(shape, axes, scale=0.02, quant_axis=None):
        return ParamSpec(tuple(shape), dtype, tuple(axes), "normal", scale, quant_axis)

    def linear(shape, axes, quant_axis=0):  # contracted over `quant_axis` (the input dim)
        return w(shape, axes, quant_axis=quant_axis)

    def norm(size):
        return ParamSpec((size,), dtype, ("norm",), "ones")

    def gated(f) -> MLPParams:
        return MLPParams(
            gate_up=linear((e, 2, f), ("embed", None, "mlp")), down=linear((f, e), ("mlp", "embed"))
        )

    def layer(i: int) -> LayerParams:
        attn = MLAParams(
            kv_a=linear((e, lat + r), ("embed", None)),
            kv_a_norm=norm(lat),
            w_uk=w((h, dn, lat), ("q_heads", None, None), 0.1),
            w_uv=w((h, lat, dv), ("q_heads", None, None), 0.1),
            o=linear((h * dv, e), ("q_heads", "embed")),
            q=None if lq else linear((e, h * (dn + r)), ("embed", "q_heads")),
            q_a=linear((e, lq), ("embed", None)) if lq else None,
            q_a_norm=norm(lq) if lq else None,
            q_b=linear((lq, h * (dn + r)), (None, "q_heads")) if lq else None,
        )
        if not cfg.is_moe_layer(i):
            return LayerParams(
                attn_norm=norm(e), attn=attn, mlp_norm=norm(e), mlp=gated(cfg.intermediate_size)
            )
        x, fm = cfg.num_experts, cfg.moe_intermediate_size
        sparse = MoEParams(
            router=w((e, x), ("embed", None)),
            gate_up=linear((x, e, 2, fm), ("experts", "embed", None, "expert_mlp"), 1),
            down=linear((x, fm, e), ("experts", "expert_mlp", "embed"), 1),
            router_bias=(
                ParamSpec((x,), jnp.float32, (None,), "zeros")
                if cfg.topk_method == "noaux_tc"
                else None
            ),
        )
        shared = gated(fm * cfg.num_shared_experts) if cfg.num_shared_experts else None
        return LayerParams(
            attn_norm=norm(e), attn=attn, mlp_norm=norm(e), mlp=sparse, shared=shared
        )

    specs = Params(
        embed=linear((v, e), ("vocab", "embed"), 1),  # NOTE: one scale per vocab row
        layers=tuple(layer(i) for i in range(cfg.num_layers)),
        final_norm=norm(e),
        lm_head=linear((e, v), ("embed", "vocab")),
    )
    return quantize_specs(specs, quantization)


def _rope_perm(r: int, interleave: bool) -> np.ndarray:
    """Column order that turns (x0, x1), (x2, x3)... pairs into (evens | odds) halves."""
    return np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)]) if interleave else np.arange(r)


def _hf_name_map(cfg: ModelConfig, names: Iterable[str]) -> dict[str, tuple | list[tuple]]:
    """HF tensor name -> entry (or entries) as in `llama_weights.hf_name_map`."""
    h, dn, r, lat, dv = (
        cfg.num_heads,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.kv_lora_rank,
        cfg.v_head_dim,
    )
    perm = _rope_perm(r, cfg.rope_interleave)
    q_cols = np.concatenate([np.arange(dn), dn + perm])  # per head: nope, then rope (permuted)
    kv_cols = np.concatenate([np.arange(lat), lat + perm])

    def q_layout(x):  # [H*(Dn+R), in] -> [in, H*(Dn+R)] with each head's rope columns permuted
        x = x.T
        return x.reshape(x.shape[0], h, dn + r)[:, :, q_cols].reshape(x.shape[0], -1)

    def kv_b(x):  # [H*(Dn+Dv), L] -> [H, Dn+Dv, L]
        return x.reshape(h, dn + dv, lat)

    out: dict[str, tuple | list[tuple]] = {
        "model.embed_tokens.weight": (("embed",), ident),
        "model.norm.weight": (("final_norm",), ident),
        "lm_head.weight": (("lm_head",), transpose),
    }
    for i in range(cfg.num_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        L, A = ("layers", i), ("layers", i, "attn")
        out.update(
            {
                p + "input_layernorm.weight": (L + ("attn_norm",), ident),
                p + "post_attention_layernorm.weight": (L + ("mlp_norm",), ident),
                a + "kv_a_proj_with_mqa.weight": (A + ("kv_a",), lambda x: x.T[:, kv_cols]),
                a + "kv_a_layernorm.weight": (A + ("kv_a_norm",), ident),
                a + "kv_b_proj.weight": [
                    (A + ("w_uk",), lambda x: kv_b(x)[:, :dn]),
                    (A + ("w_uv",), lambda x: kv_b(x)[:, dn:].transpose(0, 2, 1)),
                ],
                a + "o_proj.weight": (A + ("o",), transpose),
            }
        )
        if cfg.q_lora_rank:
            out.update(
                {
                    a + "q_a_proj.weight": (A + ("q_a",), transpose),
                    a + "q_a_layernorm.weight": (A + ("q_a_norm",), ident),
                    a + "q_b_proj.weight": (A + ("q_b",), q_layout),
                }
            )
        else:
            out[a + "q_proj.weight"] = (A + ("q",), q_layout)
        if cfg.is_moe_layer(i):
            out.update(moe_expert_names(cfg, i, names))  # mlp.gate + mlp.experts.*
            if cfg.topk_method == "noaux_tc":
                out[p + "mlp.gate.e_score_correction_bias"] = (L + ("mlp", "router_bias"), ident)
            if cfg.num_shared_experts:
                s, S = p + "mlp.shared_experts.", L + ("shared",)
                out.update(
                    {
                        s + "gate_proj.weight": (S + ("gate_up",), transpose, 0),
                        s + "up_proj.weight": (S + ("gate_up",), transpose, 1),
                        s + "down_proj.weight": (S + ("down",), transpose),
                    }
                )
        else:
            out.update(
                {
                    p + "mlp.gate_proj.weight": (L + ("mlp", "gate_up"), transpose, 0),
                    p + "mlp.up_proj.weight": (L + ("mlp", "gate_up"), transpose, 1),
                    p + "mlp.down_proj.weight": (L + ("mlp", "down"), transpose),
                }
            )
    return out


def params_from_hf(
    cfg: ModelConfig,
    names: Iterable[str],
    get_tensor: Callable[[str], np.ndarray],
    dtype: Any = jnp.float32,
    put: Callable[[np.ndarray, ParamSpec], Any] | None = None,
    quantization: str | None = None,
    get_quantized: Callable[[str, str, int], tuple[np.ndarray, np.ndarray] | None] | None = None,
) -> Params:
    """Fills the params tree from HF-named tensors; every mismatch raises naming the tensor.
    `quantization` / `get_quantized`: as in `llama.params_from_hf`."""
    names = list(names)
    mtp = range(cfg.num_layers, cfg.num_layers + cfg.num_nextn_predict_layers)

    def skip(name: str) -> bool:  # the multi-token-prediction layers (V3's layer 61)
        m = _LAYER.match(name)
        return bool(IGNORED.match(name)) or (m is not None and int(m.group(1)) in mtp)

    return fill_params(
        param_specs(cfg, dtype, quantization),
        _hf_name_map(cfg, names),
        names,
        get_tensor,
        put,
        what=cfg.model_type,
        skip=skip,
        get_quantized=get_quantized,
    )


def _mla_block(
    p: MLAParams,
    cfg: ModelConfig,
    x: jax.Array,
    step: StepInputs,
    cos: jax.Array,
    sin: jax.Array,
    kv_cache: jax.Array,
    kernels: Kernels,
    par: Parallel,
):
    """x [T, E] -> [T, E] (all-reduced). Under tensor parallelism p.q/q_b/w_uk/w_uv/o hold this
    shard's heads; kv_a and the latent cache are whole on every shard."""
    t = x.shape[0]
    h = cfg.num_heads // par.dense
    dn, r, lat = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    eps = cfg.rms_norm_eps
    with jax.named_scope("q_proj"):
        if cfg.q_lora_rank:
            (qa,) = layers.dense(x, p.q_a, backend=kernels.linear)  # [T, Lq]
            (q,) = layers.dense(layers.rms_norm(qa, p.q_a_norm, eps), p.q_b, backend=kernels.linear)
        else:
            (q,) = layers.dense(x, p.q, backend=kernels.linear)  # [T, h*(Dn+R)]
        q = q.reshape(t, h, dn + r)
        q_nope, q_rope = q[..., :dn], q[..., dn:]
    with jax.named_scope("kv_a_proj"):
        (kv,) = layers.dense(x, p.kv_a, backend=kernels.linear)  # [T, L+R]
        latent = layers.rms_norm(kv[:, :lat], p.kv_a_norm, eps)
    with jax.named_scope("rope"):
        q_rope = layers.apply_rope(q_rope, cos, sin)
        k_rope = layers.apply_rope(kv[:, None, lat:], cos, sin)[:, 0]
    with jax.named_scope("absorb_uk"):
        q_lat = jnp.einsum("thn,hnl->thl", q_nope, p.w_uk)
    out, kv_cache = mla.mla_attention(
        jnp.concatenate([q_lat, q_rope.astype(q_lat.dtype)], axis=-1),
        jnp.concatenate([latent, k_rope.astype(latent.dtype)], axis=-1),
        kv_cache,
        step,
        sm_scale=cfg.sm_scale,
        kv_lora_rank=lat,
        backend=kernels.attention,
    )  # [T, h, L]
    with jax.named_scope("absorb_uv"):
        out = jnp.einsum("thl,hlv->thv", out, p.w_uv)
    with jax.named_scope("o_proj"):
        (out,) = layers.dense(out.reshape(t, -1), p.o, backend=kernels.linear)
        return par.psum(out, EXPERT, TENSOR), kv_cache


def _decoder_layer(
    p: LayerParams,
    cfg: ModelConfig,
    h: jax.Array,
    step: StepInputs,
    cos,
    sin,
    kv_cache: jax.Array,
    kernels: Kernels,
    par: Parallel,
):
    eps = cfg.rms_norm_eps
    with jax.named_scope("attention"):
        x, kv_cache = _mla_block(
            p.attn,
            cfg,
            layers.rms_norm(h, p.attn_norm, eps),
            step,
            cos,
            sin,
            kv_cache,
            kernels,
            par,
        )
        h = h + x
    with jax.named_scope("mlp"):
        x = layers.rms_norm(h, p.mlp_norm, eps)
        if isinstance(p.mlp, MoEParams):
            y = moe.moe_mlp(x, p.mlp, cfg, par, step.slot_mapping >= 0)
            if p.shared is not None:
                with jax.named_scope("shared_experts"):
                    y = y + layers.gated_mlp(
                        x, p.shared.gate_up, p.shared.down, cfg.activation, kernels.linear
                    )
        else:
            y = layers.gated_mlp(x, p.mlp.gate_up, p.mlp.down, cfg.activation, kernels.linear)
        h = h + par.psum(y, EXPERT, TENSOR)  # partial sums over experts and F slices
    return h, kv_cache


def _forward_local(
    params: Params,
    cfg: ModelConfig,
    step: StepInputs,
    kv_caches: tuple[jax.Array, ...],
    kernels: Kernels,
    par: Parallel,
):
    with jax.named_scope("embed"):
        h = llama.embed_tokens(params.embed, cfg, step.token_ids, par, params.final_norm.dtype)
    with jax.named_scope("rope_tables"):
        cos, sin = layers.rope_cos_sin(cfg, step.positions, head_dim=cfg.qk_rope_head_dim)
    new_caches = []
    for i, layer in enumerate(params.layers):
        with jax.named_scope(f"layer_{i}"):
            h, cache = _decoder_layer(layer, cfg, h, step, cos, sin, kv_caches[i], kernels, par)
        new_caches.append(cache)
    with jax.named_scope("logits"):
        logits = llama.final_logits(
            params, cfg, jnp.take(h, step.logits_indices, axis=0), kernels.linear
        )
    return logits, tuple(new_caches)


def kv_cache_shape(
    cfg: ModelConfig, backend: str | None, num_pages: int, page_size: int, par: Parallel = SINGLE
) -> tuple[int, ...]:
    """A layer's global cache shape, from the MLA backend (`[P, page, L + R]`)."""
    del par  # NOTE: the latent rows are shared by all heads: the same on every head shard
    return mla.kv_cache_shape(backend, num_pages, page_size, cfg.kv_lora_rank, cfg.qk_rope_head_dim)


def kv_cache_bytes_per_token(
    cfg: ModelConfig,
    par: Parallel,
    itemsize: int,
    kv_cache_dtype: str = "auto",
    backend: str | None = None,
    page_size: int = 16,
) -> int:
    """(kv_lora_rank + qk_rope_head_dim) x dtype bytes x layers, on every device."""
    del par, backend, page_size
    check_kv_cache_dtype(cfg, None, kv_cache_dtype)
    return (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * itemsize * cfg.num_layers


def check_kv_cache_dtype(cfg: ModelConfig, backend: str | None, kv_cache_dtype: str) -> None:
    """The latent cache is stored in the model dtype: anything but 'auto' raises naming the field."""
    del backend
    if kv_cache_dtype != "auto":
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not supported for {cfg.model_type} "
            f"(MLA latent cache, kept in the model dtype); use kv_cache_dtype='auto'"
        )


def kv_cache_spec(cfg: ModelConfig, par: Parallel, backend: str | None = None) -> PartitionSpec:
    """A layer's cache [data*P, page, L + R]: pages per data replica, replicated elsewhere."""
    del cfg, par, backend
    return PartitionSpec(DATA, None, None)


def kv_cache_specs(
    cfg: ModelConfig, par: Parallel, cache: Any, backend: str | None = None
) -> PartitionSpec:
    """`kv_cache_spec` for one layer's cache pytree (always one array: no fp8 latent cache)."""
    del cache, backend
    return kv_cache_spec(cfg, par)


def forward(
    params: Params,
    cfg: ModelConfig,
    step: StepInputs,
    kv_caches: tuple[jax.Array, ...],  # per layer [P, page_size, L + R]
    *,
    attention_backend: str = "reference",
    linear_backend: str = "xla",
    mesh: Mesh | None = None,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Returns (logits f32[N, V] at step.logits_indices, updated kv_caches); the contract of
    `llama.forward` (data replicas stacked on a leading dim, logits sharded on vocab)."""
    if Parallel.from_mesh(mesh).pipeline > 1:
        raise ValueError(
            f"{cfg.model_type}: pipeline parallelism is not supported (dense and MoE "
            f"layers differ in kind); use the data, expert and tensor axes"
        )
    return sharded.forward(
        _forward_local,
        param_specs,
        kv_cache_specs,
        params,
        cfg,
        step,
        kv_caches,
        attention_backend=attention_backend,
        linear_backend=linear_backend,
        mesh=mesh,
    )


forward_jit = jax.jit(
    forward,
    static_argnames=("cfg", "attention_backend", "linear_backend", "mesh"),
    donate_argnames=("kv_caches",),
)
