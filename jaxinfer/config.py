"""Model and engine configuration.

1. `ModelConfig.from_hf(config_dict)` reads a Hugging Face `config.json` dict (GGUF metadata is first
   turned into the same kind of dict by `checkpoints.gguf`), checks every field that changes the
   math against the families we support, and returns a frozen, hashable dataclass of architecture
   numbers only, so it can be a static argument of `jax.jit`.
2. Fields that would change the numerics but that we do not implement raise `UnsupportedConfigError`
   naming the field; nothing is silently ignored.
3. `EngineConfig` holds the runtime knobs (page size, number of pages, batching budgets, dtype).
   The mesh is never part of `ModelConfig`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
from typing import Any

log = logging.getLogger(__name__)

# NOTE: model_type -> family defaults. DeepSeek runs through `jaxinfer.models.deepseek`, every other
# family through `jaxinfer.models.llama` (`jaxinfer.models.family_of`). A `gemma3` config (the
# multimodal wrapper) is read through its `text_config`.
SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "mixtral",
    "qwen3_moe",
    "deepseek_v2",
    "deepseek_v3",
)
DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
MOE_MODEL_TYPES = ("mixtral", "qwen3_moe")
GEMMA_MODEL_TYPES = ("gemma", "gemma2", "gemma3_text")
# NOTE: MoE config fields that only matter when training (load-balancing loss, router noise); they
# are accepted and ignored. Every other MoE field either changes the math we run or raises.
MOE_TRAINING_ONLY_FIELDS = ("router_aux_loss_coef", "output_router_logits", "router_jitter_noise")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SUPPORTED_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
    "gelu": "gelu",
}


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
            m = _yarn_mscale(float(self.rope.get("factor")), float(self.rope.get("mscale_all_dim")))
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
        """Builds a ModelConfig from a Hugging Face config.json dict; raises on anything unsupported."""
        return _from_hf(hf)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> ModelConfig:
        with open(path) as f:
            return cls.from_hf(json.load(f))


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _require(hf: dict[str, Any], key: str) -> Any:
    if key not in hf or hf[key] is None:
        raise UnsupportedConfigError(f"config is missing required field {key!r}")
    return hf[key]


# `rope_theta` when a config.json leaves it out: each family's own HF config class default.
DEFAULT_ROPE_THETA = {"mixtral": 1e6, "gemma3_text": 1e6}
GEMMA3_LOCAL_ROPE_THETA = 10000.0  # HF Gemma3TextConfig's `rope_local_base_freq` default


def _rope_from_hf(hf: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (theta inside); older configs write `rope_theta` and
    # `rope_scaling`. Accept both.
    params = dict(hf.get("rope_parameters") or {})
    if "full_attention" in params:  # transformers >= 5 Gemma 3: one dict per layer type
        params = dict(params["full_attention"] or {})
    legacy = hf.get("rope_scaling")
    if legacy:
        params = {**dict(legacy), **params}
    default_theta = DEFAULT_ROPE_THETA.get(hf.get("model_type"), 10000.0)
    theta = float(params.pop("rope_theta", hf.get("rope_theta", default_theta)))
    return _rope_config(hf, params, theta)


def _local_rope_from_hf(hf: dict[str, Any]) -> RopeConfig | None:
    """Gemma 3's sliding-window layers: their own base (`rope_local_base_freq`), never scaled."""
    if hf.get("model_type") != "gemma3_text":
        return None
    params = dict((hf.get("rope_parameters") or {}).get("sliding_attention") or {})
    theta = float(
        params.pop("rope_theta", hf.get("rope_local_base_freq") or GEMMA3_LOCAL_ROPE_THETA)
    )
    return _rope_config(hf, params, theta)


def _rope_config(hf: dict[str, Any], params: dict[str, Any], theta: float) -> RopeConfig:
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


def _layer_windows(hf: dict[str, Any], model_type: str, num_layers: int) -> tuple[int | None, ...]:
    window = hf.get("sliding_window")
    layer_types = hf.get("layer_types")
    if model_type == "qwen3_moe" and not hf.get("use_sliding_window", False):
        window = None  # HF Qwen3-MoE drops sliding_window unless use_sliding_window; then every layer slides
    if model_type == "qwen2" and not hf.get("use_sliding_window", False):
        return (None,) * num_layers
    if model_type in ("llama", "gemma", "qwen3") and layer_types is None:
        if model_type == "qwen3" and hf.get("use_sliding_window", False):
            raise UnsupportedConfigError("qwen3 use_sliding_window=True is not supported")
        return (None,) * num_layers
    if layer_types is None:
        if model_type == "gemma2":
            # Gemma 2 alternates: even layers sliding, odd layers global.
            layer_types = [
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
            ]
        elif model_type == "gemma3_text":
            # Gemma 3: every `sliding_window_pattern`-th layer is global (5 local : 1 global).
            pattern = hf.get("sliding_window_pattern")
            pattern = 6 if pattern is None else int(pattern)
            if pattern < 1:
                raise UnsupportedConfigError(f"sliding_window_pattern must be >= 1, got {pattern}")
            layer_types = [
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                for i in range(num_layers)
            ]
        else:
            layer_types = ["sliding_attention" if window else "full_attention"] * num_layers
    if len(layer_types) != num_layers:
        raise UnsupportedConfigError(
            f"layer_types has {len(layer_types)} entries for {num_layers} layers"
        )
    windows = []
    for i, kind in enumerate(layer_types):
        if kind == "full_attention":
            windows.append(None)
        elif kind == "sliding_attention":
            if not window:
                raise UnsupportedConfigError(
                    f"layer {i} is sliding_attention but sliding_window is unset"
                )
            windows.append(int(window))
        else:
            raise UnsupportedConfigError(f"layer_types[{i}] = {kind!r} is not supported")
    return tuple(windows)


def _from_hf(hf: dict[str, Any]) -> ModelConfig:
    model_type = hf.get("model_type")
    if model_type == "gemma3" and isinstance(hf.get("text_config"), dict):
        # The multimodal Gemma 3 wrapper: the text model is all we serve.
        text = hf["text_config"]
        hf = {
            "tie_word_embeddings": hf.get("tie_word_embeddings", True),
            **text,
            "model_type": "gemma3_text",
        }
        model_type = "gemma3_text"
    if model_type not in SUPPORTED_MODEL_TYPES:
        archs = hf.get("architectures")
        raise UnsupportedConfigError(
            f"unsupported architecture model_type={model_type!r} (architectures={archs}); "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    hidden = int(_require(hf, "hidden_size"))
    heads = int(_require(hf, "num_attention_heads"))
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise UnsupportedConfigError(
            f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )
    head_dim = int(hf.get("head_dim") or hidden // heads)
    num_layers = int(_require(hf, "num_hidden_layers"))
    gemma = model_type in GEMMA_MODEL_TYPES
    if model_type in DEEPSEEK_MODEL_TYPES:
        return _deepseek_from_hf(hf, model_type)

    act_name = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if gemma and act_name == "gelu":
        act_name = "gelu_pytorch_tanh"  # HF Gemma uses the tanh approximation whatever config says
    if act_name not in SUPPORTED_ACTIVATIONS:
        raise UnsupportedConfigError(f"hidden_act {act_name!r} is not supported")
    if hf.get("mlp_bias"):
        raise UnsupportedConfigError("mlp_bias=True is not supported")
    if model_type in ("llama", "mistral", "qwen3") and hf.get("pretraining_tp", 1) not in (1, None):
        raise UnsupportedConfigError("pretraining_tp != 1 is not supported")
    if hf.get("use_bidirectional_attention"):
        raise UnsupportedConfigError("use_bidirectional_attention=True is not supported")

    attention_bias = bool(hf.get("attention_bias", False))
    moe = _moe_from_hf(hf, model_type, num_layers)
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(_require(hf, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_require(hf, "intermediate_size")),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(hf.get("max_position_embeddings") or 2048),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=_rope_from_hf(hf),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
        activation=SUPPORTED_ACTIVATIONS[act_name],
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=attention_bias and model_type not in ("qwen2",),
        qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
        norm_offset=1.0 if gemma else 0.0,
        embed_scale=gemma,
        sandwich_norm=model_type in ("gemma2", "gemma3_text"),
        query_pre_attn_scalar=_query_pre_attn_scalar(hf, model_type),
        attn_logit_softcap=_attn_logit_softcap(hf, model_type),
        final_logit_softcap=(
            float(hf["final_logit_softcapping"]) if hf.get("final_logit_softcapping") else None
        ),
        local_rope=_local_rope_from_hf(hf),
        layer_windows=_layer_windows(hf, model_type, num_layers),
        **moe,
    )


def _attn_logit_softcap(hf: dict[str, Any], model_type: str) -> float | None:
    cap = hf.get("attn_logit_softcapping")
    if not cap:
        return None
    if model_type == "gemma3_text":
        # NOTE: Gemma 3's attention has no soft cap: transformers keeps the field but never applies
        # it (nor does vLLM); we match them, saying so.
        log.warning(
            "gemma3_text: attn_logit_softcapping=%s is not applied (Gemma 3 attention has "
            "no soft cap, as in transformers)",
            cap,
        )
        return None
    return float(cap)


def _query_pre_attn_scalar(hf: dict[str, Any], model_type: str) -> float | None:
    if model_type == "gemma3_text":  # HF Gemma3TextConfig default: 256
        return float(hf.get("query_pre_attn_scalar") or 256)
    if model_type == "gemma2" and hf.get("query_pre_attn_scalar"):
        return float(hf["query_pre_attn_scalar"])
    return None


_MOE_FIELD = re.compile(r"expert|router|moe|topk|top_k|sparse|routed|n_group")
_MOE_FIELDS = (
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
)


def _moe_from_hf(hf: dict[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    """The MoE fields of ModelConfig: Mixtral (softmax → top-k → renormalise, every layer sparse)
    and Qwen3-MoE (`norm_topk_prob`, dense layers from `mlp_only_layers`/`decoder_sparse_step`)."""
    if model_type not in MOE_MODEL_TYPES:
        for key in ("num_local_experts", "num_experts", "moe_intermediate_size"):
            if hf.get(key):
                raise UnsupportedConfigError(
                    f"{key}={hf[key]} on model_type={model_type!r}: "
                    f"mixture of experts is supported for {MOE_MODEL_TYPES}"
                )
        return {}
    # NOTE: any other expert/router field (shared experts, routed scaling, group-limited top-k,
    # router bias...) would change the math: refuse it by name rather than ignore it.
    for key in sorted(hf):
        if (
            _MOE_FIELD.search(key)
            and key not in _MOE_FIELDS
            and key not in MOE_TRAINING_ONLY_FIELDS
            and hf[key] not in (None, False, 0, [], {})
        ):
            raise UnsupportedConfigError(f"{model_type}: {key}={hf[key]!r} is not supported")
    # NOTE: transformers aliases num_experts and num_local_experts in both families (hub Mixtral
    # configs write the latter, hub Qwen3-MoE the former, transformers 5 writes num_local_experts).
    counts = {k: int(hf[k]) for k in ("num_local_experts", "num_experts") if hf.get(k) is not None}
    if not counts:
        raise UnsupportedConfigError(
            f"{model_type} config is missing required field 'num_experts' (or 'num_local_experts')"
        )
    if len(set(counts.values())) > 1:
        raise UnsupportedConfigError(
            f"{model_type}: num_local_experts and num_experts differ: {counts}"
        )
    num_experts = next(iter(counts.values()))
    if model_type == "mixtral":
        ffn = int(_require(hf, "intermediate_size"))
        norm_topk, moe_layers = True, (True,) * num_layers
    else:
        ffn = int(_require(hf, "moe_intermediate_size"))
        norm_topk = bool(hf.get("norm_topk_prob", False))
        step = int(1 if hf.get("decoder_sparse_step") is None else hf["decoder_sparse_step"])
        if step < 1:
            raise UnsupportedConfigError(f"decoder_sparse_step must be >= 1, got {step}")
        dense = set(hf.get("mlp_only_layers") or ())
        if bad := sorted(i for i in dense if not 0 <= int(i) < num_layers):
            raise UnsupportedConfigError(f"mlp_only_layers {bad} are outside 0..{num_layers - 1}")
        moe_layers = tuple(
            num_experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(num_layers)
        )
    top_k = int(_require(hf, "num_experts_per_tok"))
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise UnsupportedConfigError(
            f"{model_type}: num_experts_per_tok={top_k} must be in 1..number of experts ({num_experts})"
        )
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=ffn,
        norm_topk_prob=norm_topk,
        moe_layers=moe_layers,
    )


# DeepSeek fields that change nothing at inference: training losses, the expert-parallel size the
# checkpoint was trained with, and the multi-token-prediction layers (speculative heads we do not run;
# their tensors are skipped when loading).
DEEPSEEK_IGNORED_FIELDS = (
    "aux_loss_alpha",
    "seq_aux",
    "output_router_logits",
    "router_aux_loss_coef",
    "ep_size",
    "num_nextn_predict_layers",
    "num_mtp_layers",
)
DEEPSEEK_TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def _deepseek_from_hf(hf: dict[str, Any], model_type: str) -> ModelConfig:
    """DeepSeek-V2/V3: MLA attention, MoE with shared experts and group-limited routing."""
    num_layers = int(_require(hf, "num_hidden_layers"))
    heads = int(_require(hf, "num_attention_heads"))
    hidden = int(_require(hf, "hidden_size"))
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    if kv_heads != heads:
        raise UnsupportedConfigError(
            f"{model_type}: num_key_value_heads={kv_heads} != "
            f"num_attention_heads={heads} is not an MLA model"
        )
    mla = {
        k: int(_require(hf, k))
        for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    }
    if min(mla.values()) < 1:
        raise UnsupportedConfigError(f"{model_type}: MLA dims must be >= 1, got {mla}")
    if mla["qk_rope_head_dim"] % 2:
        raise UnsupportedConfigError(
            f"{model_type}: qk_rope_head_dim={mla['qk_rope_head_dim']} is odd"
        )
    q_lora = int(hf.get("q_lora_rank") or 0)
    act_name = hf.get("hidden_act") or "silu"
    if act_name not in SUPPORTED_ACTIVATIONS:
        raise UnsupportedConfigError(f"hidden_act {act_name!r} is not supported")
    for key in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
        if hf.get(key):
            raise UnsupportedConfigError(f"{model_type}: {key}=True is not supported")
    if hf.get("pretraining_tp", 1) not in (1, None):
        raise UnsupportedConfigError("pretraining_tp != 1 is not supported")
    moe = _deepseek_moe_from_hf(hf, model_type, num_layers)
    rope = _rope_from_hf(hf)
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(_require(hf, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_require(hf, "intermediate_size")),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"],
        max_position_embeddings=int(hf.get("max_position_embeddings") or 2048),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=rope,
        activation=SUPPORTED_ACTIVATIONS[act_name],
        layer_windows=(None,) * num_layers,
        q_lora_rank=q_lora,
        # HF DeepSeek-V2 and the original V2/V3 code rotate (x0, x1) pairs; transformers' V3
        # port rotates halves only when a config sets rope_interleave=False.
        rope_interleave=model_type == "deepseek_v2" or bool(hf.get("rope_interleave", True)),
        num_nextn_predict_layers=int(
            hf.get("num_nextn_predict_layers") or hf.get("num_mtp_layers") or 0
        ),
        **mla,
        **moe,
    )


def _deepseek_moe_from_hf(hf: dict[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    known = (
        "n_routed_experts",
        "num_local_experts",
        "num_experts",
        "n_shared_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "routed_scaling_factor",
        "n_group",
        "topk_group",
        "topk_method",
        "scoring_func",
        "first_k_dense_replace",
        "moe_layer_freq",
    )
    for key in sorted(hf):
        if (
            _MOE_FIELD.search(key)
            and key not in known
            and key not in DEEPSEEK_IGNORED_FIELDS
            and hf[key] not in (None, False, 0, [], {})
        ):
            raise UnsupportedConfigError(f"{model_type}: {key}={hf[key]!r} is not supported")
    counts = {
        int(hf[k])
        for k in ("n_routed_experts", "num_local_experts", "num_experts")
        if hf.get(k) is not None
    }
    if len(counts) > 1:
        raise UnsupportedConfigError(
            f"{model_type}: n_routed_experts / num_experts differ: {counts}"
        )
    num_experts = counts.pop() if counts else 0
    v3 = model_type == "deepseek_v3"
    method = hf.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    if method not in DEEPSEEK_TOPK_METHODS:
        raise UnsupportedConfigError(
            f"{model_type}: topk_method={method!r} is not supported "
            f"(supported: {DEEPSEEK_TOPK_METHODS})"
        )
    scoring = hf.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    if scoring not in ("softmax", "sigmoid"):
        raise UnsupportedConfigError(f"{model_type}: scoring_func={scoring!r} is not supported")
    if v3 and (method != "noaux_tc" or scoring != "sigmoid"):
        raise UnsupportedConfigError(
            f"{model_type}: topk_method={method!r} with scoring_func="
            f"{scoring!r} is not supported (V3 routes noaux_tc + sigmoid)"
        )
    if not v3 and (method == "noaux_tc" or scoring != "softmax"):
        raise UnsupportedConfigError(
            f"{model_type}: topk_method={method!r} with scoring_func="
            f"{scoring!r} is not supported (V2 routes by softmax)"
        )
    if not num_experts:
        return dict(topk_method=method, scoring_func=scoring)
    top_k = int(_require(hf, "num_experts_per_tok"))
    n_group = int(hf.get("n_group") or 1)
    topk_group = int(hf.get("topk_group") or 1)
    if method == "greedy":
        n_group = topk_group = 1  # HF's greedy routing ignores the groups
    if num_experts % n_group or not 1 <= topk_group <= n_group:
        raise UnsupportedConfigError(
            f"{model_type}: n_group={n_group} must divide n_routed_experts="
            f"{num_experts} and topk_group={topk_group} be in 1..n_group"
        )
    if not 1 <= top_k <= num_experts // n_group * topk_group:
        raise UnsupportedConfigError(
            f"{model_type}: num_experts_per_tok={top_k} must be in 1..the "
            f"experts of the topk_group={topk_group} groups"
        )
    if method == "noaux_tc" and num_experts // n_group < 2:
        raise UnsupportedConfigError(
            f"{model_type}: noaux_tc ranks groups by their top-2 experts; "
            f"n_group={n_group} leaves fewer than 2 per group"
        )
    first_dense = int(hf.get("first_k_dense_replace") or 0)
    freq = int(hf.get("moe_layer_freq") or 1)
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(_require(hf, "moe_intermediate_size")),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        moe_layers=tuple(i >= first_dense and i % freq == 0 for i in range(num_layers)),
        scoring_func=scoring,
        topk_method=method,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
        num_shared_experts=int(hf.get("n_shared_experts") or 0),
    )


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
    # The device mesh, e.g. "tensor=4" or "data=2,tensor=4" (see `sharding.parse_mesh`); "" is
    # one device. With data=N, num_pages and max_num_seqs are totals split evenly over the N
    # replicas and max_num_batched_tokens is each replica's per-step budget.
    mesh: str = ""
    # Most prompt tokens one request computes per step (None: up to max_num_batched_tokens).
    # Smaller values keep a new prompt's prefill from stalling the running decodes (tail ITL).
    long_prefill_token_threshold: int | None = None
    # Schedule and launch step N+1 before step N's sampled tokens reach the host (they are fed
    # on the device), so host work overlaps device work; one speculative decode step is wasted
    # per request that stops on EOS / a stop token. Multi-host runs step synchronously.
    async_scheduling: bool = True
    # Speculative decoding (`jaxinfer.spec_decode.SpeculativeConfig`; a dict or JSON string is
    # parsed): e.g. {"method": "ngram", "num_speculative_tokens": 4}. None: off.
    speculative_config: Any = None
    # Weight-only quantization of the linear weights and the embedding: None, "int8" or "fp8"
    # (float8_e4m3fn); int8 keeps one f32 scale per output channel and group of 128 input
    # channels, fp8 one per output channel (see `jaxinfer.quantization`).
    quantization: str | None = None
    # The paged KV cache's storage: "auto" (the model dtype) or "fp8" (float8_e4m3fn values with a
    # power-of-two scale per slot and K/V head: (D + 1) bytes a row instead of 2 * D in bf16).
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        from jaxinfer.spec_decode.config import SpeculativeConfig  # NOTE: no JAX there either

        object.__setattr__(
            self, "speculative_config", SpeculativeConfig.parse(self.speculative_config)
        )
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.quantization not in (None, "int8", "fp8"):
            raise ValueError(
                f"quantization={self.quantization!r} is not supported; choose one of "
                f"('int8', 'fp8') (or None)"
            )
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; choose one of "
                f"('auto', 'fp8')"
            )
        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 1:
            raise ValueError(
                "long_prefill_token_threshold must be >= 1 (or None for no cap), "
                f"got {self.long_prefill_token_threshold}"
            )
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2, got {self.num_pages}")
        from jaxinfer.sharding import parse_mesh  # NOTE: lazy: config imports no JAX

        parse_mesh(self.mesh)  # unknown axes and bad sizes fail here, naming the axis


def pages_needed(num_tokens: int, page_size: int) -> int:
    return math.ceil(num_tokens / page_size)
