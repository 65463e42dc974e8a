"""Model and engine configuration.

1. `ModelConfig.from_hf(config_dict)` reads a Hugging Face `config.json` dict (GGUF metadata is first
   turned into the same kind of dict by `checkpoints.gguf`) and hands it to the family registered
   for its `model_type` (`jaxinfer.models.registry`; each family's HF parsing lives beside it in
   `jaxinfer/models/`). The family checks every field that changes the math and returns a frozen,
   hashable dataclass of architecture numbers only, so it can be a static argument of `jax.jit`.
2. Fields that would change the numerics but that we do not implement raise `UnsupportedConfigError`
   naming the field; nothing is silently ignored. The helpers every family's parser shares (required
   fields, RoPE, activations, unknown MoE fields) live here.
3. `EngineConfig` holds the runtime knobs (page size, number of pages, batching budgets, dtype).
   The mesh is never part of `ModelConfig`: `EngineConfig.mesh` is the mesh string, which
   `parse_mesh` reads into axis sizes without devices (`jaxinfer.sharding.make_mesh` builds it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Collection
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SUPPORTED_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
    "gelu": "gelu",
}


# The device mesh's axes, major first (`jaxinfer.sharding` names each: DATA, PIPELINE, ...).
MESH_AXES = ("data", "pipeline", "expert", "tensor")


class UnsupportedConfigError(ValueError):
    """A checkpoint's config asks for an architecture or feature jaxinfer does not implement."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters. `scaling` is a sorted tuple of (key, value) pairs."""

    theta: float = 10000.0
    rope_type: str = "default"
    scaling: tuple[tuple[str, Any], ...] = ()

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.scaling).get(key, default)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture numbers of a decoder-only transformer (hashable; usable as a jit static arg)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    activation: str = "silu"  # "silu" (SwiGLU) | "gelu_tanh" / "gelu" (GeGLU)
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before rope
    norm_offset: float = 0.0  # Gemma: RMSNorm scales by (1 + w)
    embed_scale: bool = False  # Gemma: embeddings multiplied by sqrt(hidden_size)
    sandwich_norm: bool = False  # Gemma 2: extra norms after attention and after the MLP
    query_pre_attn_scalar: float | None = None  # Gemma 2: sm_scale = scalar ** -0.5
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # Gemma 3: the rotary embedding of the sliding-window layers (`rope` is the global layers').
    local_rope: RopeConfig | None = None
    # Per layer: the sliding window (number of keys a query may see, itself included) or None.
    layer_windows: tuple[int | None, ...] = ()
    # Qwen2.5-VL's M-RoPE: rotary pairs per position row (t, h, w), summing to head_dim / 2; the
    # step then carries `StepInputs.mrope_positions` i32[3, T] when it holds image tokens.
    mrope_section: tuple[int, ...] | None = None
    # Mixture of experts (Mixtral, Qwen3-MoE): 0 experts = dense everywhere.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # F of each expert (dense layers keep intermediate_size)
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    moe_layers: tuple[bool, ...] = ()  # per layer: sparse MoE block (True) or dense gated MLP
    # DeepSeek MoE routing: scores "softmax" | "sigmoid"; `topk_method` "greedy" (plain top-k),
    # "group_limited_greedy" (V2: experts only from the `topk_group` of `n_group` groups with the
    # best max score) or "noaux_tc" (V3: groups ranked by their top-2 biased scores; the router
    # has an `e_score_correction_bias` that picks experts but does not weight them).
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # routed experts' weights are multiplied by it
    num_shared_experts: int = 0  # always-on experts: one gated MLP of F = n * moe_intermediate_size
    # Multi-head latent attention (DeepSeek-V2/V3); kv_lora_rank > 0 turns it on. Then num_kv_heads
    # == num_heads and head_dim == qk_nope_head_dim + qk_rope_head_dim (HF's qk_head_dim).
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: the query is projected straight from the hidden state (V2-Lite)
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # checkpoint's rope dims are (x0, x1) pairs (DeepSeek's layout)
    num_nextn_predict_layers: int = 0  # DeepSeek-V3 MTP layers after the last: skipped at load

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def is_moe_layer(self, i: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[i]

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def sm_scale(self) -> float:
        if self.query_pre_attn_scalar is not None:
            return float(self.query_pre_attn_scalar) ** -0.5
        scale = self.head_dim**-0.5
        if self.is_mla and self.rope.rope_type != "default" and self.rope.get("mscale_all_dim"):
            # DeepSeek's YaRN: the softmax scale also carries mscale(factor, mscale_all_dim)^2.
            m = yarn_mscale(float(self.rope.get("factor")), float(self.rope.get("mscale_all_dim")))
            scale *= m * m
        return scale

    def num_params(self) -> int:
        """Number of weights (embedding counted once when tied)."""
        e, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = e * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        if self.is_mla:  # as checkpoints store them (kv_b_proj whole, before it is split)
            h, lq, lkv, r = (
                self.num_heads,
                self.q_lora_rank,
                self.kv_lora_rank,
                self.qk_rope_head_dim,
            )
            q = e * lq + lq + lq * h * d if lq else e * h * d
            attn = (
                q
                + e * (lkv + r)
                + lkv
                + lkv * h * (self.qk_nope_head_dim + self.v_head_dim)
                + h * self.v_head_dim * e
            )
        norms = e * (4 if self.sandwich_norm else 2) + (2 * d if self.qk_norm else 0)
        dense = 3 * e * f
        sparse = self.num_experts * (e + 3 * e * self.moe_intermediate_size)  # router + experts
        sparse += 3 * e * self.moe_intermediate_size * self.num_shared_experts
        sparse += self.num_experts if self.topk_method == "noaux_tc" else 0  # router bias
        mlps = sum(sparse if self.is_moe_layer(i) else dense for i in range(self.num_layers))
        head = 0 if self.tie_word_embeddings else self.vocab_size * e
        return self.vocab_size * e + self.num_layers * (attn + norms) + mlps + e + head

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Builds a ModelConfig from a Hugging Face config.json dict; raises on anything unsupported
        (an unknown `model_type` names it and lists the registered ones)."""
        from jaxinfer.models import registry  # NOTE: lazy: the families import this module

        return registry.parse_hf(hf)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> ModelConfig:
        with open(path) as f:
            return cls.from_hf(json.load(f))


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def require(hf: dict[str, Any], key: str) -> Any:
    """`hf[key]`, raising naming the field when it is missing or null."""
    if key not in hf or hf[key] is None:
        raise UnsupportedConfigError(f"config is missing required field {key!r}")
    return hf[key]


def activation_of(name: str) -> str:
    """Our activation name for HF's `hidden_act` `name`; raises naming it when unsupported."""
    if name not in SUPPORTED_ACTIVATIONS:
        raise UnsupportedConfigError(f"hidden_act {name!r} is not supported")
    return SUPPORTED_ACTIVATIONS[name]


def rope_from_hf(hf: dict[str, Any], default_theta: float = 10000.0) -> RopeConfig:
    """The rotary embedding of a config (of its global layers when it has several); `default_theta`
    is the family's HF config class default, used when the config leaves `rope_theta` out."""
    # transformers >= 5 writes `rope_parameters` (theta inside); older configs write `rope_theta` and
    # `rope_scaling`. Accept both.
    params = dict(hf.get("rope_parameters") or {})
    if "full_attention" in params:  # transformers >= 5 Gemma 3: one dict per layer type
        params = dict(params["full_attention"] or {})
    legacy = hf.get("rope_scaling")
    if legacy:
        params = {**dict(legacy), **params}
    theta = float(params.pop("rope_theta", hf.get("rope_theta", default_theta)))
    return rope_config(hf, params, theta)


def rope_config(hf: dict[str, Any], params: dict[str, Any], theta: float) -> RopeConfig:
    """A `RopeConfig` from one rope parameter dict (`rope_type`/`type` and its scaling fields)."""
    rope_type = params.pop("rope_type", params.pop("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedConfigError(
            f"rope scaling type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
        )
    if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedConfigError("partial_rotary_factor != 1.0 is not supported")
    params.pop("partial_rotary_factor", None)
    if rope_type == "default":
        params = {}
    needed = {
        "linear": ("factor",),
        "llama3": (
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ),
        "yarn": ("factor",),
    }.get(rope_type, ())
    for key in needed:
        if key not in params:
            raise UnsupportedConfigError(f"rope scaling {rope_type!r} needs field {key!r}")
    scaling = tuple(sorted((k, v) for k, v in params.items() if v is not None))
    return RopeConfig(theta=theta, rope_type=rope_type, scaling=scaling)


# NOTE: expert/router fields. Any a family does not read would change the math (shared experts,
# routed scaling, group-limited top-k, router bias...): `reject_unknown_moe_fields` refuses it by
# name rather than ignore it.
MOE_FIELD = re.compile(r"expert|router|moe|topk|top_k|sparse|routed|n_group")


def reject_unknown_moe_fields(hf: dict[str, Any], model_type: str, known: Collection[str]) -> None:
    """Raises naming the first set expert/router field of `hf` that is not in `known`."""
    for key in sorted(hf):
        if MOE_FIELD.search(key) and key not in known and hf[key] not in (None, False, 0, [], {}):
            raise UnsupportedConfigError(f"{model_type}: {key}={hf[key]!r} is not supported")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Runtime knobs: memory layout and batching budgets (not architecture)."""

    dtype: str = "float32"
    page_size: int = 16
    num_pages: int | None = None
    kv_cache_memory: int | None = None  # bytes; used when num_pages is None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    # The device mesh, e.g. "tensor=4" or "data=2,tensor=4" (see `parse_mesh`); "" is
    # one device. With data=N, num_pages and max_num_seqs are totals split evenly over the N
    # replicas and max_num_batched_tokens is each replica's per-step budget.
    mesh: str = ""
    # Most prompt tokens one request computes per step (None: up to max_num_batched_tokens).
    # Smaller values keep a new prompt's prefill from stalling the running decodes (tail ITL).
    long_prefill_token_threshold: int | None = None
    # Images' encoder tokens one step may take (vLLM's name; None: max_num_batched_tokens): a
    # step with several new images spreads them over steps while the decodes keep running.
    max_num_encoder_input_tokens: int | None = None
    # Schedule and launch step N+1 before step N's sampled tokens reach the host (they are fed
    # on the device), so host work overlaps device work; one speculative decode step is wasted
    # per request that stops on EOS / a stop token. Multi-host runs step synchronously.
    async_scheduling: bool = True
    # Multi-step scheduling (vLLM's former `--num-scheduler-steps`): while every running request
    # is a plain decode (no token masks or images) and nobody waits, one program runs
    # up to this many decode steps, each feeding its sampled ids to the next on the device, so
    # the host's per-step cost is paid once for all (`jaxinfer.engine.multi_step`). The tokens are
    # those of single steps. One data replica, no pipeline stages (tensor / expert meshes
    # work), no speculative decoding; 1: off.
    num_scheduler_steps: int = 1
    # Speculative decoding (`jaxinfer.spec_decode.SpeculativeConfig`; a dict or JSON string is
    # parsed): e.g. {"method": "ngram", "num_speculative_tokens": 4}. None: off.
    speculative_config: Any = None
    # Weight-only quantization of the linear weights and the embedding: None, "int8", "fp8"
    # (float8_e4m3fn) or "int4"; int8 keeps one f32 scale per output channel and group of 128 input
    # channels, fp8 one per output channel, int4 a scale and an offset per group of 128 (names
    # such as "int4-g32" pick other group sizes; see `checkpoints.quantize`).
    quantization: str | None = None
    # The paged KV cache's storage: "auto" (the model dtype) or "fp8" (float8_e4m3fn values with a
    # power-of-two scale per slot and K/V head: (D + 1) bytes a row instead of 2 * D in bf16).
    kv_cache_dtype: str = "auto"
    # Multi-LoRA (vLLM's names, `jaxinfer.lora`): `max_loras` device slots of adapters of rank
    # up to `max_lora_rank` in one batch; `max_cpu_loras` parsed adapters kept on the host.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # The step token counts programs are compiled for (None: 1, 2, 4, ... up to
    # max_num_batched_tokens, which the largest must reach). Fewer buckets: fewer programs, more
    # padding; the tests use it to compile fewer programs per engine.
    token_buckets: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        from jaxinfer.spec_decode.config import SpeculativeConfig  # NOTE: no JAX there either

        object.__setattr__(
            self, "speculative_config", SpeculativeConfig.parse(self.speculative_config)
        )
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        from checkpoints.quantize import check_requested  # NOTE: numpy only, no JAX

        check_requested(self.quantization)
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; choose one of "
                f"('auto', 'fp8')"
            )
        if self.token_buckets is not None:
            buckets = tuple(sorted({int(b) for b in self.token_buckets}))
            if not buckets or buckets[0] < 1 or buckets[-1] < self.max_num_batched_tokens:
                raise ValueError(
                    f"token_buckets={self.token_buckets} must be >= 1 and reach "
                    f"max_num_batched_tokens={self.max_num_batched_tokens}"
                )
            object.__setattr__(self, "token_buckets", buckets)
        names = ("page_size", "max_num_seqs", "max_num_batched_tokens", "max_loras")
        for name in (*names, "num_scheduler_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_scheduler_steps > 1 and self.speculative_config is not None:
            raise ValueError(
                f"num_scheduler_steps={self.num_scheduler_steps} does not combine with "
                f"speculative_config (one step a program while speculating)"
            )
        sizes = parse_mesh(self.mesh)
        if self.num_scheduler_steps > 1 and (sizes["data"] > 1 or sizes["pipeline"] > 1):
            raise ValueError(
                f"num_scheduler_steps={self.num_scheduler_steps} needs one data replica and no "
                f"pipeline stages (mesh {self.mesh!r})"
            )
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 1:
            raise ValueError(
                "long_prefill_token_threshold must be >= 1 (or None for no cap), "
                f"got {self.long_prefill_token_threshold}"
            )
        if (self.max_num_encoder_input_tokens or 1) < 1:
            raise ValueError(
                "max_num_encoder_input_tokens must be >= 1 (or None: max_num_batched_tokens), "
                f"got {self.max_num_encoder_input_tokens}"
            )
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2, got {self.num_pages}")
        parse_mesh(self.mesh)  # unknown axes and bad sizes fail here, naming the axis
        if self.max_lora_rank not in (1, 8, 16, 32, 64, 128, 256, 320, 512):
            raise ValueError(f"max_lora_rank must be one of vLLM's sizes, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )


def pages_needed(num_tokens: int, page_size: int) -> int:
    return math.ceil(num_tokens / page_size)


def parse_mesh(spec: str | dict[str, int] | None) -> dict[str, int]:
    """'tensor=4,pipeline=2' -> {'data': 1, 'pipeline': 2, 'expert': 1, 'tensor': 4}."""
    sizes = dict.fromkeys(MESH_AXES, 1)
    if not spec:
        return sizes
    items = (
        spec.items()
        if isinstance(spec, dict)
        else (
            part.split("=", 1) if "=" in part else (part, "")
            for part in spec.split(",")
            if part.strip()
        )
    )
    for name, size in items:
        name = str(name).strip()
        if name not in sizes:
            raise ValueError(f"unknown mesh axis {name!r} in mesh {spec!r}; axes are {MESH_AXES}")
        try:
            sizes[name] = int(size)
        except ValueError:
            raise ValueError(f"mesh axis {name!r} needs an integer size, e.g. '{name}=2'") from None
        if sizes[name] < 1:
            raise ValueError(f"mesh axis {name!r} must be >= 1")
    return sizes
