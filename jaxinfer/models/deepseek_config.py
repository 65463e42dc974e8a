"""DeepSeek-V2 / V3 Hugging Face config parsing (JAX-free): MLA attention and MoE with shared
experts and group-limited routing. The family runs through `jaxinfer.models.deepseek`.

1. `deepseek_from_hf(hf)` reads the MLA dims (`kv_lora_rank`, `q_lora_rank`, the nope/rope/value
   head dims), refuses what would change the math, and reads the routing (`_moe_from_hf`): V2
   softmax + greedy / group-limited top-k, V3 sigmoid + noaux_tc with a correction bias.
2. Both model types are registered in `jaxinfer.models.registry` at import.
"""

from __future__ import annotations

from typing import Any

from jaxinfer.config import (
    ModelConfig,
    UnsupportedConfigError,
    activation_of,
    reject_unknown_moe_fields,
    require,
    rope_from_hf,
)
from jaxinfer.models import registry

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


def deepseek_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """DeepSeek-V2/V3: MLA attention, MoE with shared experts and group-limited routing."""
    model_type = hf["model_type"]
    num_layers = int(require(hf, "num_hidden_layers"))
    heads = int(require(hf, "num_attention_heads"))
    hidden = int(require(hf, "hidden_size"))
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    if kv_heads != heads:
        raise UnsupportedConfigError(
            f"{model_type}: num_key_value_heads={kv_heads} != "
            f"num_attention_heads={heads} is not an MLA model"
        )
    mla = {
        k: int(require(hf, k))
        for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    }
    if min(mla.values()) < 1:
        raise UnsupportedConfigError(f"{model_type}: MLA dims must be >= 1, got {mla}")
    if mla["qk_rope_head_dim"] % 2:
        raise UnsupportedConfigError(
            f"{model_type}: qk_rope_head_dim={mla['qk_rope_head_dim']} is odd"
        )
    q_lora = int(hf.get("q_lora_rank") or 0)
    activation = activation_of(hf.get("hidden_act") or "silu")
    for key in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
        if hf.get(key):
            raise UnsupportedConfigError(f"{model_type}: {key}=True is not supported")
    if hf.get("pretraining_tp", 1) not in (1, None):
        raise UnsupportedConfigError("pretraining_tp != 1 is not supported")
    moe = _moe_from_hf(hf, model_type, num_layers)
    rope = rope_from_hf(hf)
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(require(hf, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(require(hf, "intermediate_size")),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"],
        max_position_embeddings=int(hf.get("max_position_embeddings") or 2048),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=rope,
        activation=activation,
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


def _moe_from_hf(hf: dict[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
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
    reject_unknown_moe_fields(hf, model_type, known + DEEPSEEK_IGNORED_FIELDS)
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
    top_k = int(require(hf, "num_experts_per_tok"))
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
        moe_intermediate_size=int(require(hf, "moe_intermediate_size")),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        moe_layers=tuple(i >= first_dense and i % freq == 0 for i in range(num_layers)),
        scoring_func=scoring,
        topk_method=method,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
        num_shared_experts=int(hf.get("n_shared_experts") or 0),
    )


registry.register(
    registry.Family(
        "deepseek_v2", "jaxinfer.models.deepseek", deepseek_from_hf, ("DeepseekV2ForCausalLM",)
    )
)
registry.register(
    registry.Family(
        "deepseek_v3", "jaxinfer.models.deepseek", deepseek_from_hf, ("DeepseekV3ForCausalLM",)
    )
)
