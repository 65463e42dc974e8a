"""The Llama family: Llama 2/3, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3, SmolLM2.

One decoder, switched by `ModelConfig` fields (QKV bias, QK-norm, (1+w) norms, embedding scale,
GeGLU, sandwich norms, soft-caps, per-layer sliding windows, a separate RoPE for the sliding-window
layers as in Gemma 3).

1. `param_specs(cfg, dtype)` declares every weight once (shape, dtype, logical axes). Linear
   weights are stored `[in, out]` (split per head where heads matter) so no weight is transposed
   inside the jitted step (see ARCHITECTURE.md §6), and the projections of one input are stored
   fused at load (q/k/v in `qkv`, gate/up in `gate_up`): one product each per layer, no weight
   concatenated in the step.
2. `params_from_hf(cfg, names, get_tensor, dtype)` maps Hugging Face tensor names onto that tree
   (`llama_weights`: the names, as the family's `llama_config.LlamaLike` declares them;
   `hf_weights.fill_params`: the filling), raising on missing, unexpected or mis-shaped tensors.
3. `forward(params, cfg, step, kv_caches)` runs the ragged step: embed → layers (attention over the
   paged cache, gated MLP) → final norm → logits only at `step.logits_indices`.
4. `forward(..., mesh=)` runs that same code inside one `shard_map` over the mesh
   (`sharded.forward`; manual SPMD, Megatron style): each device holds its shards (qkv split by
   KV groups: its query heads with the K/V heads they read; gate_up by MLP columns, its gate and
   up halves side by side; o/down row-split, embedding and LM head split by vocab) and `Parallel`
   adds the all-reduces: one after o_proj and one after the MLP down projection per layer (biases after
   them), one for the vocab-parallel embedding. Logits leave sharded on vocab. Those splits run
   over `par.dense` shards: `tensor` on dense models, `expert` x `tensor` on MoE models (the
   expert axis doubles as tensor parallelism outside the experts, `sharding.dense_axes`), with
   the all-reduces over both axes; the MoE block keeps its experts on `expert`, their hidden dim
   on `tensor`.

Einsum legend: t = token, e = embed, f = heads*head_dim or MLP hidden, v = vocab.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, PartitionSpec

from jaxinfer import attention as attention_lib
from jaxinfer import layers, moe
from jaxinfer import pipeline as pipeline_lib
from jaxinfer.attention import attention
from jaxinfer.config import ModelConfig
from jaxinfer.lora import device as lora_device
from jaxinfer.models import sharded
from jaxinfer.models.hf_weights import IGNORED, fill_params
from jaxinfer.models.llama_weights import checkpoint_view, hf_name_map, renamed
from jaxinfer.models.sharded import SINGLE, Kernels
from jaxinfer.moe import MoEParams
from jaxinfer.params import ParamSpec
from jaxinfer.quantization import QArray, quantize_specs
from jaxinfer.sharding import (
    DATA,
    EXPERT,
    TENSOR,
    Parallel,
    dense_axes,
    kv_cache_heads,
    kv_heads_split,
)
from jaxinfer.step import StepInputs
from pallas_kernels.ragged_paged_attention.reference import Fp8KVCache


@struct.dataclass
class AttentionParams:
    # [E, Hkv, G+2, D], G = Hq/Hkv: Q, K and V projections fused (one weight read, one dot), by
    # KV group: group j holds query heads j*G..j*G+G-1 (HF's order), then K head j, then V head j
    qkv: Any
    o: Any  # [Hq*D, E]
    qkv_bias: Any = None  # [Hkv, G+2, D]
    o_bias: Any = None  # [E]
    q_norm: Any = None  # [D]
    k_norm: Any = None  # [D]


@struct.dataclass
class MLPParams:
    gate_up: Any  # [E, 2, F]  gate and up projections fused
    down: Any  # [F, E]


@struct.dataclass
class LayerParams:
    attn_norm: Any  # [E]
    attn: AttentionParams
    mlp_norm: Any  # [E]
    mlp: MLPParams | MoEParams  # MoEParams on the sparse layers of Mixtral / Qwen3-MoE
    post_attn_norm: Any = None  # [E] Gemma 2
    post_mlp_norm: Any = None  # [E] Gemma 2
    lora: Any = None  # jaxinfer.lora.device.LayerStacks: attached by the runner (enable_lora)


@struct.dataclass
class Params:
    embed: Any  # [V, E]
    layers: tuple[LayerParams, ...]
    final_norm: Any  # [E]
    lm_head: Any = None  # [E, V]; None when tied to the embedding


def param_specs(
    cfg: ModelConfig, dtype: Any = jnp.float32, quantization: str | None = None
) -> Params:
    """Every weight declared once: shape, dtype, logical axes, init; with `quantization` ("int8" |
    "fp8") the linear weights and the embedding are `QArray`s of (data, scale) specs."""
    e, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    hq, hkv, v = cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size
    # Gemma's norms multiply by (1 + w): a neutral init is zeros there, ones elsewhere.
    norm_init = "zeros" if cfg.norm_offset else "ones"

    def w(shape, axes, quant_axis=None, scale=0.02):
        return ParamSpec(tuple(shape), dtype, tuple(axes), "normal", scale, quant_axis)

    def linear(shape, axes, quant_axis=0):  # contracted over `quant_axis` (the input dim)
        return w(shape, axes, quant_axis)

    def norm(size, axis="norm"):
        return ParamSpec((size,), dtype, (axis,), norm_init)

    def sparse_mlp() -> MoEParams:
        x, fm = cfg.num_experts, cfg.moe_intermediate_size
        return MoEParams(
            router=w((e, x), ("embed", None)),
            gate_up=linear((x, e, 2, fm), ("experts", "embed", None, "expert_mlp"), 1),
            down=linear((x, fm, e), ("experts", "expert_mlp", "embed"), 1),
        )

    def layer(i: int) -> LayerParams:
        attn = AttentionParams(
            # NOTE: split by KV group, each tensor shard holds whole groups: its query heads and
            # the K/V heads they read, contiguous (replicated where the KV heads do not split).
            qkv=linear((e, hkv, hq // hkv + 2, d), ("embed", "kv_heads", None, None)),
            o=linear((hq * d, e), ("q_heads", "embed")),
            qkv_bias=w((hkv, hq // hkv + 2, d), ("kv_heads", None, None)) if cfg.qkv_bias else None,
            o_bias=w((e,), ("embed",)) if cfg.o_bias else None,
            q_norm=norm(d, "head_dim") if cfg.qk_norm else None,
            k_norm=norm(d, "head_dim") if cfg.qk_norm else None,
        )
        mlp = (
            sparse_mlp()
            if cfg.is_moe_layer(i)
            else MLPParams(
                gate_up=linear((e, 2, f), ("embed", None, "mlp")),
                down=linear((f, e), ("mlp", "embed")),
            )
        )
        return LayerParams(
            attn_norm=norm(e),
            attn=attn,
            mlp_norm=norm(e),
            mlp=mlp,
            post_attn_norm=norm(e) if cfg.sandwich_norm else None,
            post_mlp_norm=norm(e) if cfg.sandwich_norm else None,
        )

    specs = Params(
        # NOTE: quantized per vocab row (contracted over embed): a row's scale serves both the
        # lookup and, when tied, that vocab column of the LM head.
        embed=linear((v, e), ("vocab", "embed"), 1),
        layers=tuple(layer(i) for i in range(cfg.num_layers)),
        final_norm=norm(e),
        lm_head=None if cfg.tie_word_embeddings else linear((e, v), ("embed", "vocab")),
    )
    return quantize_specs(specs, quantization)


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

    `put(host_array, spec)` places each weight (e.g. `jax.device_put` onto its sharding). With
    `quantization` the weights that take it are quantized on the host, one tensor (or fused slot)
    at a time; `get_quantized(name, fmt, groups)`, when given, returns a tensor the source already
    holds quantized as (data [out, in], scale f32[out, groups]) in HF layout (None: read it with
    `get_tensor`).
    """
    names, source_name = checkpoint_view(cfg, list(names))
    if source_name:  # a multimodal wrapper's text model (Gemma 3)
        get_tensor = renamed(get_tensor, source_name)
        get_quantized = get_quantized and renamed(get_quantized, source_name)
    return fill_params(
        param_specs(cfg, dtype, quantization),
        hf_name_map(cfg, names),
        names,
        get_tensor,
        put,
        what=cfg.model_type,
        get_quantized=get_quantized,
        quantization=quantization,
        skip=lambda n: (
            bool(IGNORED.match(n)) or (cfg.tie_word_embeddings and n == "lm_head.weight")
        ),
    )


def _attention_block(
    p: AttentionParams,
    cfg: ModelConfig,
    window: int | None,
    x: jax.Array,
    step: StepInputs,
    cos: jax.Array,
    sin: jax.Array,
    kv_cache: jax.Array,
    kernels: Kernels,
    par: Parallel = SINGLE,
    lora: Callable | None = None,
    rope: tuple[jax.Array, jax.Array] | None = None,
):
    """x [T, E] -> [T, E]. Under tensor parallelism p.qkv holds this shard's KV groups (its query
    heads and their K/V heads; one of `par.dense` shards), p.o its rows: the o_proj output is a
    partial sum, all-reduced here (bias added once, after). With `rope` (the GPU backend's
    `attention.expand_rope` tables) a decode step hands the QKV product itself to
    `attention.attention_qkv` (RoPE, KV write and attention in one kernel)."""
    t, d = x.shape[0], cfg.head_dim
    shards = par.dense
    hq = cfg.num_heads // shards
    g = cfg.num_heads // cfg.num_kv_heads
    with jax.named_scope("qkv_proj"):
        # NOTE: one 2-D product (heads folded into the output dim of the stored weight): a single
        # plain contraction is ~10x faster on XLA:CPU than contracting over (heads, head_dim).
        (qkv,) = layers.dense(x, p.qkv, backend=kernels.linear)  # [T, Hkv', G+2, D]
        if cfg.qkv_bias:
            qkv = qkv + p.qkv_bias
        if lora is not None:  # each token's adapter (jaxinfer.lora.device.apply), before the split
            qkv = lora("qkv", x, qkv)
        split = kv_heads_split(cfg.num_kv_heads, shards)
    fused = rope is not None and split and not cfg.qk_norm
    if fused and attention_lib.takes_qkv(kernels.attention, qkv, kv_cache, step):
        out, kv_cache = attention_lib.attention_qkv(
            qkv,
            rope,
            kv_cache,
            step,
            sm_scale=cfg.sm_scale,
            sliding_window=window,
            soft_cap=cfg.attn_logit_softcap,
            backend=kernels.attention,
        )
        return _o_proj(p, cfg, out, kernels, par, lora), kv_cache
    with jax.named_scope("qkv_proj"):
        q, k, v = qkv[:, :, :g], qkv[:, :, g], qkv[:, :, g + 1]
        if not split:
            # NOTE: replicated KV: p.qkv holds every group; keep this shard's query heads (part of
            # one group) here, and the K/V head they read below.
            head, part = divmod(par.dense_index(), shards // cfg.num_kv_heads)
            q = jax.lax.dynamic_slice(q, (0, head, part * hq, 0), (t, 1, hq, d))
        q = q.reshape(t, hq, d)
        if not split:
            k = jax.lax.dynamic_slice_in_dim(k, head, 1, axis=1)
            v = jax.lax.dynamic_slice_in_dim(v, head, 1, axis=1)
    if cfg.local_rope is not None:  # Gemma 3: [global | local] tables, picked by the layer's kind
        half = cfg.head_dim // 2
        pick = slice(half, None) if window is not None else slice(0, half)
        cos, sin = cos[:, pick], sin[:, pick]
    if cfg.qk_norm:
        with jax.named_scope("qk_norm"):
            q = layers.rms_norm(q, p.q_norm, cfg.rms_norm_eps, cfg.norm_offset)
            k = layers.rms_norm(k, p.k_norm, cfg.rms_norm_eps, cfg.norm_offset)
    with jax.named_scope("rope"):
        q, k = layers.apply_rope(q, cos, sin), layers.apply_rope(k, cos, sin)
    out, kv_cache = attention(
        q,
        k,
        v,
        kv_cache,
        step,
        sm_scale=cfg.sm_scale,
        sliding_window=window,
        soft_cap=cfg.attn_logit_softcap,
        backend=kernels.attention,
    )
    return _o_proj(p, cfg, out, kernels, par, lora), kv_cache


def _o_proj(p: AttentionParams, cfg: ModelConfig, out, kernels: Kernels, par: Parallel, lora):
    """The attention output [T, Hq', D] -> [T, E], all-reduced under tensor parallelism."""
    with jax.named_scope("o_proj"):
        out = out.reshape(out.shape[0], -1)
        (o,) = layers.dense(out, p.o, backend=kernels.linear)
        out = o if lora is None else lora("o", out, o)  # partial sums too under TP
        out = par.psum(out, EXPERT, TENSOR)
        if cfg.o_bias:
            out = out + p.o_bias
    return out


def _decoder_layer(
    p: LayerParams,
    cfg: ModelConfig,
    window: int | None,
    h: jax.Array,
    step: StepInputs,
    cos: jax.Array,
    sin: jax.Array,
    kv_cache: jax.Array,
    kernels: Kernels,
    par: Parallel = SINGLE,
    rope: tuple[jax.Array, jax.Array] | None = None,
    delta: jax.Array | None = None,
    defer: bool = False,
):
    """h [T, E] -> (h', kv_cache). With `defer` (the GPU backend: `_forward_local`) the layer
    returns (h, kv_cache, its MLP output) and the next one adds that output to h in the launch
    of its first norm (`delta`; `layers.add_rms_norm`), as it adds its attention output in the
    MLP norm's: a residual add and an RMSNorm in one kernel, twice per layer."""
    eps, off = cfg.rms_norm_eps, cfg.norm_offset
    lora = lora_device.adapter_hook(p.lora, step.lora_slots, kernels.attention)
    with jax.named_scope("attention"):
        if delta is None:
            x = layers.rms_norm(h, p.attn_norm, eps, off)
        else:
            h, x = layers.add_rms_norm(h, delta, p.attn_norm, eps, off, gpu=True)
        x, kv_cache = _attention_block(
            p.attn, cfg, window, x, step, cos, sin, kv_cache, kernels, par, lora, rope
        )
        if cfg.sandwich_norm:
            x = layers.rms_norm(x, p.post_attn_norm, eps, off)
    with jax.named_scope("mlp"):
        h, x = layers.add_rms_norm(h, x, p.mlp_norm, eps, off, gpu=defer)
        if isinstance(p.mlp, MoEParams):
            x = moe.moe_mlp(x, p.mlp, cfg, par, step.slot_mapping >= 0)
            x = par.psum(x, EXPERT, TENSOR)
        else:
            x = layers.gated_mlp(x, p.mlp.gate_up, p.mlp.down, cfg.activation, kernels.linear, lora)
            x = par.psum(x, EXPERT, TENSOR)  # down was row-split: partial sums
        if cfg.sandwich_norm:
            x = layers.rms_norm(x, p.post_mlp_norm, eps, off)
    if defer:
        return h, kv_cache, x
    return h + x, kv_cache


def embed_tokens(
    embed: jax.Array | QArray,
    cfg: ModelConfig,
    token_ids: jax.Array,
    par: Parallel = SINGLE,
    dtype: Any = None,
) -> jax.Array:
    """Rows of `embed` [V/par.dense, E] for token_ids i32[T] -> [T, E] of `dtype` (default: the
    embedding's; a quantized one needs it), vocab-parallel on a mesh: each shard looks up the ids
    in its vocab range, zeros elsewhere, one all-reduce."""
    dtype = dtype or embed.dtype
    if par.dense == 1:
        h = layers.embed_rows(embed, token_ids, dtype)
    else:
        rows = embed.shape[0]
        local = token_ids - par.dense_index() * rows
        mine = (local >= 0) & (local < rows)
        h = layers.embed_rows(embed, jnp.where(mine, local, 0), dtype)
        h = par.psum(jnp.where(mine[:, None], h, jnp.zeros((), h.dtype)), EXPERT, TENSOR)
    if cfg.embed_scale:
        h = h * jnp.asarray(cfg.hidden_size**0.5, h.dtype)
    return h


def final_logits(params: Params, cfg: ModelConfig, h: jax.Array, linear: str = "xla") -> jax.Array:
    """h [N, E] (the rows to sample) -> f32[N, V/par.dense]: this shard's vocab columns only."""
    h = layers.rms_norm(h, params.final_norm, cfg.rms_norm_eps, cfg.norm_offset)
    if params.lm_head is None:
        logits = layers.dense_transposed(h, params.embed, backend=linear)
    else:
        (logits,) = layers.dense(h, params.lm_head, backend=linear)
    return layers.soft_cap(logits.astype(jnp.float32), cfg.final_logit_softcap)


def rope_tables(
    cfg: ModelConfig, positions: jax.Array, mrope: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """cos/sin f32[T, D/2] for positions i32[T] (M-RoPE's rows i32[3, T] when given); with
    `cfg.local_rope` (Gemma 3) f32[T, D]: the global layers' half, then the sliding-window
    layers' half (each layer slices its own)."""
    if mrope is not None and cfg.mrope_section:  # Qwen2.5-VL, a step holding image tokens
        return layers.mrope_cos_sin(cfg, mrope)
    cos, sin = layers.rope_cos_sin(cfg, positions)
    if cfg.local_rope is None:
        return cos, sin
    cos_l, sin_l = layers.rope_cos_sin(cfg, positions, rope=cfg.local_rope)
    return jnp.concatenate([cos, cos_l], axis=-1), jnp.concatenate([sin, sin_l], axis=-1)


def _forward_local(
    params: Params,
    cfg: ModelConfig,
    step: StepInputs,
    kv_caches: tuple[jax.Array, ...],
    kernels: Kernels,
    par: Parallel,
):
    """The model on local shards (the whole model when `par` is all ones)."""
    if par.pipeline > 1:
        return _forward_pipelined(params, cfg, step, kv_caches, kernels, par)
    with jax.named_scope("embed"):
        h = embed_tokens(params.embed, cfg, step.token_ids, par, params.final_norm.dtype)
        if step.mm_embeds is not None:  # image soft tokens (`jaxinfer.vision`)
            h = h.at[step.mm_rows].set(step.mm_embeds.astype(h.dtype), mode="drop")
    # NOTE: on the GPU backend each layer's MLP output is added in the next layer's first norm
    # kernel (`_decoder_layer`'s `defer`), the last one's to the rows the logits read
    gpu = kernels.attention == "gpu"
    with jax.named_scope("rope_tables"):
        cos, sin = rope_tables(cfg, step.positions, step.mrope_positions)
        rope = attention_lib.expand_rope(cos, sin) if gpu and cfg.local_rope is None else None
    new_caches, delta = [], None
    for i, layer in enumerate(params.layers):
        with jax.named_scope(f"layer_{i}"):
            window = cfg.layer_windows[i]
            out = _decoder_layer(
                layer, cfg, window, h, step, cos, sin, kv_caches[i], kernels, par, rope, delta, gpu
            )
        h, cache, delta = out if gpu else (*out, None)
        new_caches.append(cache)
    with jax.named_scope("logits"):
        h = jnp.take(h, step.logits_indices, axis=0)
        if delta is not None:
            h = h + jnp.take(delta, step.logits_indices, axis=0)
        logits = final_logits(params, cfg, h, kernels.linear)
    return logits, tuple(new_caches)


def _forward_pipelined(
    params: Params,
    cfg: ModelConfig,
    step: StepInputs,
    kv_caches: tuple[jax.Array, ...],
    kernels: Kernels,
    par: Parallel,
):
    """Pipeline mesh (see `jaxinfer.pipeline`): every `step` field has a leading [M] micro-batch
    dim, `params.layers` and `kv_caches` are this device's stage blocks; logits [M*N, V/dense]."""
    m, t = step.token_ids.shape
    with jax.named_scope("embed"):
        h = embed_tokens(
            params.embed, cfg, step.token_ids.reshape(-1), par, params.final_norm.dtype
        ).reshape(m, t, -1)
    with jax.named_scope("rope_tables"):
        cos, sin = (
            x.reshape(m, t, *x.shape[1:]) for x in rope_tables(cfg, step.positions.reshape(-1))
        )

    def layer_fn(p, window, x, mb_step, mb_cos, mb_sin, kv_cache):
        return _decoder_layer(p, cfg, window, x, mb_step, mb_cos, mb_sin, kv_cache, kernels, par)

    h, caches = pipeline_lib.pipelined_decoder(
        layer_fn,
        params.layers,
        kv_caches,
        h,
        step,
        cos,
        sin,
        windows=pipeline_lib.stage_windows(cfg.layer_windows, par.pipeline),
        num_stages=par.pipeline,
    )
    with jax.named_scope("logits"):
        logits = final_logits(params, cfg, h.reshape(-1, h.shape[-1]), kernels.linear)
    return logits, caches


def kv_cache_shape(
    cfg: ModelConfig, backend: str | None, num_pages: int, page_size: int, par: Parallel = SINGLE
) -> tuple[int, ...]:
    """A layer's global cache shape, from the attention backend (`[P, page, 2*Hkv', D]`)."""
    kv_heads = kv_cache_heads(cfg.num_kv_heads, par.dense)
    return attention_lib.kv_cache_shape(backend, num_pages, page_size, kv_heads, cfg.head_dim)


def kv_cache_bytes_per_token(
    cfg: ModelConfig,
    par: Parallel,
    itemsize: int,
    kv_cache_dtype: str = "auto",
    backend: str | None = "reference",
    page_size: int = 16,
) -> int:
    """Cache bytes one token takes on one device, over all layers (its share of the KV heads):
    rows of `itemsize`-byte values, or fp8 rows with their exponent byte (the backend's layout:
    the TPU one pads rows to 128 lanes)."""
    kv_heads = kv_cache_heads(cfg.num_kv_heads, par.dense) // par.dense
    row_bytes = attention_lib.kv_cache_bytes_per_row(
        cfg.head_dim, itemsize, kv_cache_dtype, backend, page_size
    )
    return math.ceil(2 * kv_heads * row_bytes * cfg.num_layers)


def check_kv_cache_dtype(cfg: ModelConfig, backend: str, kv_cache_dtype: str) -> None:
    """Raises naming `kv_cache_dtype` when it is unknown or the resolved `backend` cannot read it."""
    del cfg
    attention_lib.check_kv_cache_dtype(backend, kv_cache_dtype)


def kv_cache_spec(cfg: ModelConfig, par: Parallel, backend: str | None = None) -> PartitionSpec:
    """A layer's cache [data*P, page, 2*Hkv', D] on the mesh: pages per data replica, KV heads
    (K/V interleaved, so each shard keeps whole (K, V) pairs) over the attention's shards
    (`dense_axes`: tensor, or expert x tensor); the TPU layout's [data*P, Hkv', page, W] alike."""
    spec = [DATA, None, None, None]
    spec[attention_lib.kv_cache_heads_axis(backend)] = dense_axes(cfg, par)
    return PartitionSpec(*spec)


def kv_cache_specs(cfg: ModelConfig, par: Parallel, cache: Any, backend: str | None = None) -> Any:
    """`kv_cache_spec` for one layer's cache pytree: an fp8 cache's exponents ([data*P, page,
    2*Hkv'], the TPU layout's [Hkv', data*P, 1, E]) split like its values."""
    spec = kv_cache_spec(cfg, par, backend)
    if isinstance(cache, Fp8KVCache):
        if cache.exponent.ndim == 4:  # the TPU layout: heads lead
            return Fp8KVCache(spec, PartitionSpec(spec[1], spec[0], None, None))
        return Fp8KVCache(spec, PartitionSpec(*spec[: cache.exponent.ndim]))
    return spec


def forward(
    params: Params,
    cfg: ModelConfig,
    step: StepInputs,
    kv_caches: tuple[jax.Array, ...],  # per layer [P, page_size, 2*Hkv, D]
    *,
    attention_backend: str = "reference",
    linear_backend: str = "xla",
    mesh: Mesh | None = None,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Returns (logits f32[N, V] at step.logits_indices, updated kv_caches).

    `attention_backend` ("auto" | "reference" | "cpu" | "gpu" | "tpu") is static: see `jaxinfer.attention`.
    `linear_backend` ("auto" | "xla" | "cpu" | "gpu") is static: see `jaxinfer.layers.resolve_linear_backend`.
    With a `mesh` (static) the whole model runs inside one `shard_map` over it (manual SPMD, see
    `sharding.Parallel`). Then, when the mesh has `data` > 1, every `step` field carries a leading
    `[data]` dim (one ragged step per replica, same buckets), each layer's cache holds `data`
    page pools back to back (`[data*P, ...]`, page ids local to the replica) and the logits come
    back `[data, N, V]`. Logits leave sharded on vocab over `tensor` (`expert` x `tensor` on MoE
    models; never gathered here).
    """
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
