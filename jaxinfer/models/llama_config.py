"""The llama-like families' Hugging Face config parsing (JAX-free): Llama, Mistral, Qwen2, Qwen3,
Gemma, Gemma 2, Gemma 3, Mixtral, Qwen3-MoE. All of them run through `jaxinfer.models.llama`, one
decoder switched by `ModelConfig` fields.

1. Each family is one `LlamaLike` declaration at the end of this file: its HF `model_type` and
   `architectures`, the defaults its HF config class uses (rope theta, tied embeddings), the flags
   that set its `ModelConfig` fields (QKV bias, QK-norm, Gemma's norms, sandwich norms, Gemma 3's
   local RoPE...), its sliding-window rule and, for MoE families, its expert rule and tensor names.
2. `register_llama_like(decl)` registers it in `jaxinfer.models.registry`; `ModelConfig.from_hf`
   then calls `decl.parse(hf)`, which reads the fields every llama-like config shares, checks the
   ones that would change the math, and applies the declaration.
3. `llama_weights` reads the declaration of `cfg.model_type` (`declaration`) for the checkpoint's
   tensor names (expert names, a multimodal wrapper's prefixes).

To add a llama-like family: append one `register_llama_like(LlamaLike(...))` below, naming its
model_type, architectures and only what differs from Llama (a window rule from those here, or a new
one beside them); then add its tiny config to `tests/model_utils.py` so it is checked against
transformers. The registry, `family_of`, the loader and the forward need no change.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from jaxinfer.config import (
    ModelConfig,
    RopeConfig,
    UnsupportedConfigError,
    activation_of,
    reject_unknown_moe_fields,
    require,
    rope_config,
    rope_from_hf,
)
from jaxinfer.models import registry

log = logging.getLogger(__name__)

Windows = tuple[int | None, ...]
# (hf, num_layers, num_experts) -> (expert F, renormalise the top-k, per layer: sparse or dense)
Experts = Callable[[dict[str, Any], int, int], tuple[int, bool, tuple[bool, ...]]]

# NOTE: MoE config fields that only matter when training (load-balancing loss, router noise); they
# are accepted and ignored. Every other MoE field either changes the math we run or raises.
MOE_TRAINING_ONLY_FIELDS = ("router_aux_loss_coef", "output_router_logits", "router_jitter_noise")
_MOE_FIELDS = (
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
)


def _windows(
    hf: dict[str, Any], layer_types: list[str] | None, window: Any, num_layers: int
) -> Windows:
    """Per layer: the sliding window or None, from `layer_types` (default: every layer slides when
    `window` is set, none otherwise)."""
    if layer_types is None:
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


def sliding_window(hf: dict[str, Any], num_layers: int) -> Windows:
    """Mistral, Mixtral: every layer slides when `sliding_window` is set (unless `layer_types`)."""
    return _windows(hf, hf.get("layer_types"), hf.get("sliding_window"), num_layers)


def full_attention(hf: dict[str, Any], num_layers: int) -> Windows:
    """Llama, Gemma: `sliding_window` is ignored unless `layer_types` names sliding layers."""
    if hf.get("layer_types") is None:
        return (None,) * num_layers
    return sliding_window(hf, num_layers)


def qwen3_windows(hf: dict[str, Any], num_layers: int) -> Windows:
    if hf.get("layer_types") is None and hf.get("use_sliding_window", False):
        raise UnsupportedConfigError("qwen3 use_sliding_window=True is not supported")
    return full_attention(hf, num_layers)


def opt_in_sliding_window(hf: dict[str, Any], num_layers: int) -> Windows:
    """Qwen2: full attention everywhere unless `use_sliding_window`."""
    if not hf.get("use_sliding_window", False):
        return (None,) * num_layers
    return sliding_window(hf, num_layers)


def qwen3_moe_windows(hf: dict[str, Any], num_layers: int) -> Windows:
    """HF Qwen3-MoE drops `sliding_window` unless `use_sliding_window`; then every layer slides."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    return _windows(hf, hf.get("layer_types"), window, num_layers)


def gemma2_windows(hf: dict[str, Any], num_layers: int) -> Windows:
    """Gemma 2 alternates (without `layer_types`): even layers sliding, odd layers global."""
    types = hf.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
    ]
    return _windows(hf, types, hf.get("sliding_window"), num_layers)


def gemma3_windows(hf: dict[str, Any], num_layers: int) -> Windows:
    """Gemma 3 (without `layer_types`): every `sliding_window_pattern`-th layer is global (5:1)."""
    types = hf.get("layer_types")
    if types is None:
        pattern = hf.get("sliding_window_pattern")
        pattern = 6 if pattern is None else int(pattern)
        if pattern < 1:
            raise UnsupportedConfigError(f"sliding_window_pattern must be >= 1, got {pattern}")
        types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(num_layers)
        ]
    return _windows(hf, types, hf.get("sliding_window"), num_layers)


def mixtral_experts(hf: dict[str, Any], num_layers: int, num_experts: int):
    """Mixtral: softmax -> top-k -> renormalise; every layer sparse, experts of F=intermediate_size."""
    del num_experts
    return int(require(hf, "intermediate_size")), True, (True,) * num_layers


def qwen3_moe_experts(hf: dict[str, Any], num_layers: int, num_experts: int):
    """Qwen3-MoE: `norm_topk_prob`; dense layers from `mlp_only_layers` / `decoder_sparse_step`."""
    ffn = int(require(hf, "moe_intermediate_size"))
    step = int(1 if hf.get("decoder_sparse_step") is None else hf["decoder_sparse_step"])
    if step < 1:
        raise UnsupportedConfigError(f"decoder_sparse_step must be >= 1, got {step}")
    dense = set(hf.get("mlp_only_layers") or ())
    if bad := sorted(i for i in dense if not 0 <= int(i) < num_layers):
        raise UnsupportedConfigError(f"mlp_only_layers {bad} are outside 0..{num_layers - 1}")
    moe_layers = tuple(
        num_experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(num_layers)
    )
    return ffn, bool(hf.get("norm_topk_prob", False)), moe_layers


@dataclasses.dataclass(frozen=True)
class LlamaLike:
    """One llama-like family: how its HF config (and checkpoint names) map onto `models.llama`."""

    model_type: str
    architectures: tuple[str, ...] = ()
    rope_theta: float = 10000.0  # when config.json leaves `rope_theta` out (HF class default)
    tie_word_embeddings: bool = False  # likewise
    qkv_bias: bool = False  # q/k/v always biased, o never (Qwen2); else `attention_bias`: all four
    qk_norm: bool = False  # RMSNorm over head_dim on q and k (Qwen3, Gemma 3)
    gemma: bool = False  # (1 + w) RMSNorm, embeddings x sqrt(E), "gelu" read as tanh-GELU
    sandwich_norm: bool = False  # extra norms after attention and after the MLP (Gemma 2, 3)
    checks_pretraining_tp: bool = False  # refuse `pretraining_tp` != 1
    # Gemma 2 / 3: read `query_pre_attn_scalar` (sm_scale = scalar ** -0.5), with this default.
    reads_query_pre_attn_scalar: bool = False
    query_pre_attn_scalar: float | None = None
    applies_attn_softcap: bool = True  # False: Gemma 3 keeps the field but never applies it
    local_rope_theta: float | None = None  # Gemma 3: the sliding-window layers' own RoPE base
    windows: Callable[[dict[str, Any], int], Windows] = full_attention
    experts: Experts | None = None  # a mixture-of-experts family's expert rule
    # Checkpoint names (read by `llama_weights`): the MoE block's module and its expert projections
    # (gate, up, down), and a multimodal wrapper's prefixes -> the text model's, beside the prefixes
    # of tensors that are not served (vision).
    expert_tensors: tuple[str, tuple[str, str, str]] = (
        "mlp",
        ("gate_proj", "up_proj", "down_proj"),
    )
    text_prefixes: tuple[tuple[str, str], ...] = ()
    skipped_prefixes: tuple[str, ...] = ()

    def parse(self, hf: dict[str, Any]) -> ModelConfig:
        """The `ModelConfig` of this family's HF config dict `hf` (raises on the unsupported)."""
        model_type = self.model_type
        hidden = int(require(hf, "hidden_size"))
        heads = int(require(hf, "num_attention_heads"))
        kv_heads = int(hf.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise UnsupportedConfigError(
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        num_layers = int(require(hf, "num_hidden_layers"))
        act_name = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
        if self.gemma and act_name == "gelu":
            act_name = "gelu_pytorch_tanh"  # HF Gemma uses the tanh approximation whatever it says
        activation = activation_of(act_name)
        if hf.get("mlp_bias"):
            raise UnsupportedConfigError("mlp_bias=True is not supported")
        if self.checks_pretraining_tp and hf.get("pretraining_tp", 1) not in (1, None):
            raise UnsupportedConfigError("pretraining_tp != 1 is not supported")
        if hf.get("use_bidirectional_attention"):
            raise UnsupportedConfigError("use_bidirectional_attention=True is not supported")
        attention_bias = bool(hf.get("attention_bias", False))
        return ModelConfig(
            model_type=model_type,
            vocab_size=int(require(hf, "vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(require(hf, "intermediate_size")),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(hf.get("head_dim") or hidden // heads),
            max_position_embeddings=int(hf.get("max_position_embeddings") or 2048),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=rope_from_hf(hf, self.rope_theta),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", self.tie_word_embeddings)),
            activation=activation,
            qkv_bias=self.qkv_bias or attention_bias,
            o_bias=attention_bias and not self.qkv_bias,
            qk_norm=self.qk_norm,
            norm_offset=1.0 if self.gemma else 0.0,
            embed_scale=self.gemma,
            sandwich_norm=self.sandwich_norm,
            query_pre_attn_scalar=self._query_pre_attn_scalar(hf),
            attn_logit_softcap=self._attn_logit_softcap(hf),
            final_logit_softcap=(
                float(hf["final_logit_softcapping"]) if hf.get("final_logit_softcapping") else None
            ),
            local_rope=self._local_rope(hf),
            layer_windows=self.windows(hf, num_layers),
            **self._moe(hf, num_layers),
        )

    def _query_pre_attn_scalar(self, hf: dict[str, Any]) -> float | None:
        if not self.reads_query_pre_attn_scalar:
            return None
        scalar = hf.get("query_pre_attn_scalar") or self.query_pre_attn_scalar
        return float(scalar) if scalar else None

    def _attn_logit_softcap(self, hf: dict[str, Any]) -> float | None:
        cap = hf.get("attn_logit_softcapping")
        if not cap:
            return None
        if not self.applies_attn_softcap:
            # NOTE: Gemma 3's attention has no soft cap: transformers keeps the field but never
            # applies it (nor does vLLM); we match them, saying so.
            log.warning(
                "%s: attn_logit_softcapping=%s is not applied (Gemma 3 attention has "
                "no soft cap, as in transformers)",
                self.model_type,
                cap,
            )
            return None
        return float(cap)

    def _local_rope(self, hf: dict[str, Any]) -> RopeConfig | None:
        """Gemma 3's sliding-window layers: their own base (`rope_local_base_freq`), unscaled."""
        if self.local_rope_theta is None:
            return None
        params = dict((hf.get("rope_parameters") or {}).get("sliding_attention") or {})
        base = hf.get("rope_local_base_freq") or self.local_rope_theta
        return rope_config(hf, params, float(params.pop("rope_theta", base)))

    def _moe(self, hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
        """The MoE fields of ModelConfig ({} for a dense family, which refuses expert fields)."""
        model_type = self.model_type
        if self.experts is None:
            for key in ("num_local_experts", "num_experts", "moe_intermediate_size"):
                if hf.get(key):
                    moe_types = tuple(
                        t for t in registry.supported_model_types() if _is_moe_family(t)
                    )
                    raise UnsupportedConfigError(
                        f"{key}={hf[key]} on model_type={model_type!r}: "
                        f"mixture of experts is supported for {moe_types}"
                    )
            return {}
        reject_unknown_moe_fields(hf, model_type, _MOE_FIELDS + MOE_TRAINING_ONLY_FIELDS)
        # NOTE: transformers aliases num_experts and num_local_experts in both MoE families (hub
        # Mixtral configs write the latter, hub Qwen3-MoE the former, transformers 5
        # num_local_experts).
        counts = {
            k: int(hf[k]) for k in ("num_local_experts", "num_experts") if hf.get(k) is not None
        }
        if not counts:
            raise UnsupportedConfigError(
                f"{model_type} config is missing required field 'num_experts' "
                f"(or 'num_local_experts')"
            )
        if len(set(counts.values())) > 1:
            raise UnsupportedConfigError(
                f"{model_type}: num_local_experts and num_experts differ: {counts}"
            )
        num_experts = next(iter(counts.values()))
        ffn, norm_topk, moe_layers = self.experts(hf, num_layers, num_experts)
        top_k = int(require(hf, "num_experts_per_tok"))
        if num_experts < 1 or not 1 <= top_k <= num_experts:
            raise UnsupportedConfigError(
                f"{model_type}: num_experts_per_tok={top_k} must be in 1..number of experts "
                f"({num_experts})"
            )
        return dict(
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=ffn,
            norm_topk_prob=norm_topk,
            moe_layers=moe_layers,
        )


def _is_moe_family(model_type: str) -> bool:
    decl = registry.family(model_type).declaration
    return isinstance(decl, LlamaLike) and decl.experts is not None


def register_llama_like(decl: LlamaLike) -> LlamaLike:
    """Registers a llama-like family: `ModelConfig.from_hf` parses it, `models.llama` runs it."""
    registry.register(
        registry.Family(
            decl.model_type, "jaxinfer.models.llama", decl.parse, decl.architectures, decl
        )
    )
    return decl


def declaration(model_type: str) -> LlamaLike:
    """The `LlamaLike` registered for `model_type` (raises naming it when there is none)."""
    decl = registry.family(model_type).declaration
    if not isinstance(decl, LlamaLike):
        raise UnsupportedConfigError(f"model_type {model_type!r} is not a llama-like family")
    return decl


_GEMMA = dict(gemma=True, tie_word_embeddings=True)

register_llama_like(LlamaLike("llama", ("LlamaForCausalLM",), checks_pretraining_tp=True))
register_llama_like(
    LlamaLike(
        "mistral", ("MistralForCausalLM",), checks_pretraining_tp=True, windows=sliding_window
    )
)
register_llama_like(
    LlamaLike("qwen2", ("Qwen2ForCausalLM",), qkv_bias=True, windows=opt_in_sliding_window)
)
register_llama_like(
    LlamaLike(
        "qwen3",
        ("Qwen3ForCausalLM",),
        qk_norm=True,
        checks_pretraining_tp=True,
        windows=qwen3_windows,
    )
)
register_llama_like(LlamaLike("gemma", ("GemmaForCausalLM",), **_GEMMA))
register_llama_like(
    LlamaLike(
        "gemma2",
        ("Gemma2ForCausalLM",),
        sandwich_norm=True,
        reads_query_pre_attn_scalar=True,
        windows=gemma2_windows,
        **_GEMMA,
    )
)
GEMMA3_TEXT = register_llama_like(
    LlamaLike(
        "gemma3_text",
        ("Gemma3ForCausalLM",),
        rope_theta=1e6,
        qk_norm=True,
        sandwich_norm=True,
        reads_query_pre_attn_scalar=True,
        query_pre_attn_scalar=256.0,  # HF Gemma3TextConfig's default
        applies_attn_softcap=False,
        local_rope_theta=10000.0,  # HF Gemma3TextConfig's `rope_local_base_freq` default
        windows=gemma3_windows,
        # The multimodal checkpoint (Gemma3ForConditionalGeneration): its text model under these
        # prefixes (hub files / transformers 5 in memory), beside vision tensors we do not serve.
        text_prefixes=(
            ("language_model.model.", "model."),
            ("model.language_model.", "model."),
            ("language_model.lm_head.", "lm_head."),
        ),
        skipped_prefixes=(
            "vision_tower.",
            "multi_modal_projector.",
            "model.vision_tower.",
            "model.multi_modal_projector.",
        ),
        **_GEMMA,
    )
)
# Qwen2.5-VL's text model: Qwen2 with M-RoPE (hub files: `model.*` beside `visual.*`;
# transformers 5 in memory: `model.language_model.*`, `model.visual.*`).
QWEN2_5_VL_TEXT = register_llama_like(
    LlamaLike(
        "qwen2_5_vl_text",
        qkv_bias=True,
        rope_theta=1e6,
        windows=opt_in_sliding_window,
        text_prefixes=(("model.language_model.", "model."),),
        skipped_prefixes=("visual.", "model.visual."),
    )
)
register_llama_like(
    LlamaLike(
        "mixtral",
        ("MixtralForCausalLM",),
        rope_theta=1e6,
        windows=sliding_window,
        experts=mixtral_experts,
        expert_tensors=("block_sparse_moe", ("w1", "w3", "w2")),
    )
)
register_llama_like(
    LlamaLike(
        "qwen3_moe",
        ("Qwen3MoeForCausalLM",),
        qk_norm=True,
        windows=qwen3_moe_windows,
        experts=qwen3_moe_experts,
    )
)


def _gemma3_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """The multimodal Gemma 3 wrapper: its `text_config` is the model we serve (`gemma3_text`)."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise UnsupportedConfigError("model_type='gemma3' config has no 'text_config' dict")
    tied = hf.get("tie_word_embeddings", True)
    return GEMMA3_TEXT.parse(
        {"tie_word_embeddings": tied, **text, "model_type": GEMMA3_TEXT.model_type}
    )


registry.register(
    registry.Family(
        "gemma3", "jaxinfer.models.llama", _gemma3_from_hf, ("Gemma3ForConditionalGeneration",)
    )
)


def _qwen2_5_vl_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Qwen2.5-VL: its text model (`text_config`, or the top-level fields of older configs) with
    the rope's `mrope_section` (rope type "mrope" in older configs) as `ModelConfig.mrope_section`."""
    text = {k: v for k, v in hf.items() if k not in ("text_config", "vision_config")}
    text.update(hf.get("text_config") or {})
    section = None
    for key in ("rope_parameters", "rope_scaling"):
        params = dict(text.get(key) or {})
        if "mrope_section" in params:
            section = tuple(int(x) for x in params.pop("mrope_section"))
            for name in ("type", "rope_type"):
                if params.get(name) == "mrope":
                    params[name] = "default"
            text[key] = params
    cfg = QWEN2_5_VL_TEXT.parse({**text, "model_type": QWEN2_5_VL_TEXT.model_type})
    if section is None:
        raise UnsupportedConfigError("qwen2_5_vl: the rope parameters have no 'mrope_section'")
    if sum(section) != cfg.head_dim // 2 or len(section) != 3:
        raise UnsupportedConfigError(
            f"qwen2_5_vl: mrope_section {list(section)} must be 3 numbers summing to head_dim / 2 "
            f"({cfg.head_dim // 2})"
        )
    return dataclasses.replace(cfg, mrope_section=section)


registry.register(
    registry.Family(
        "qwen2_5_vl",
        "jaxinfer.models.llama",
        _qwen2_5_vl_from_hf,
        ("Qwen2_5_VLForConditionalGeneration",),
    )
)
