"""The llama-like families' Hugging Face checkpoint names (`models.llama.params_from_hf` uses them).

1. `checkpoint_view(cfg, names)`: the tensor names as the text model's (a multimodal wrapper's
   prefixes, e.g. Gemma 3's `language_model.`, mapped back; its vision tensors left out, as the
   family's `LlamaLike` declares), and each one's name in the checkpoint.
2. `hf_name_map(cfg, names)`: each HF tensor name -> its place in `llama.Params` and the transform
   from HF's layout (`[out, in]`) to ours (`[in, out]`; q/k/v fused by KV group and gate/up fused,
   each tensor written into its slot of the fused leaf, `qkv_slots`); expert
   tensors in the layout the checkpoint uses, named as the family declares.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from jaxinfer.config import ModelConfig
from jaxinfer.models.hf_weights import ident, moe_expert_names, transpose, transpose_to
from jaxinfer.models.llama_config import declaration


def hf_name_map(cfg: ModelConfig, names: Iterable[str] = ()) -> dict[str, tuple]:
    """HF tensor name -> (path into Params, transform from the HF layout to ours[, slot]).

    A `slot` places the tensor at index `slot` of the leaf's second-to-last axis (fused leaves), or,
    when it is a tuple, at that index of the leaf (one expert of a stacked expert leaf; q, k or v's
    slot in every KV group of the fused `attn.qkv`, `qkv_slots`). `names` (the
    checkpoint's) picks between the per-expert and the fused expert layouts of MoE checkpoints.
    """
    decl = declaration(cfg.model_type)
    out = {
        "model.embed_tokens.weight": (("embed",), ident),
        "model.norm.weight": (("final_norm",), ident),
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (("lm_head",), transpose)
    # Gemma 2 names its pre-MLP norm pre_feedforward_layernorm; the others call it post_attention_layernorm.
    mlp_norm_name = "pre_feedforward_layernorm" if cfg.sandwich_norm else "post_attention_layernorm"
    qkv = qkv_slots(cfg)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        L = ("layers", i)
        out.update(
            {
                p + "input_layernorm.weight": (L + ("attn_norm",), ident),
                p + mlp_norm_name + ".weight": (L + ("mlp_norm",), ident),
                **{
                    f"{p}self_attn.{n}_proj.weight": (L + ("attn", "qkv"), transpose_to(*s), i)
                    for n, (s, i) in qkv.items()
                },
                p + "self_attn.o_proj.weight": (L + ("attn", "o"), transpose),
            }
        )
        if cfg.is_moe_layer(i):
            out.update(moe_expert_names(cfg, i, names, *decl.expert_tensors))
        else:
            out.update(
                {
                    p + "mlp.gate_proj.weight": (L + ("mlp", "gate_up"), transpose, 0),
                    p + "mlp.up_proj.weight": (L + ("mlp", "gate_up"), transpose, 1),
                    p + "mlp.down_proj.weight": (L + ("mlp", "down"), transpose),
                }
            )
        if cfg.qkv_bias:
            for n, (s, i) in qkv.items():
                out[f"{p}self_attn.{n}_proj.bias"] = (
                    L + ("attn", "qkv_bias"),
                    lambda b, s=s: b.reshape(s),
                    i[1:],
                )
        if cfg.o_bias:
            out[p + "self_attn.o_proj.bias"] = (L + ("attn", "o_bias"), ident)
        if cfg.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (L + ("attn", "q_norm"), ident)
            out[p + "self_attn.k_norm.weight"] = (L + ("attn", "k_norm"), ident)
        if cfg.sandwich_norm:
            out[p + "post_attention_layernorm.weight"] = (L + ("post_attn_norm",), ident)
            out[p + "post_feedforward_layernorm.weight"] = (L + ("post_mlp_norm",), ident)
    return out


def qkv_slots(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """q/k/v -> (the projection's output dims as the fused `attn.qkv` [E, Hkv, G+2, D] holds them,
    its index there): HF's query heads are already grouped by the KV head they read (head h reads
    KV head h // G), so each projection is a reshape into its slot of every group."""
    hkv, d = cfg.num_kv_heads, cfg.head_dim
    g = cfg.num_heads // hkv
    every = (slice(None), slice(None))  # all input channels, every KV group
    return {
        "q": ((hkv, g, d), every + (slice(0, g),)),
        "k": ((hkv, d), every + (g,)),
        "v": ((hkv, d), every + (g + 1,)),
    }


def checkpoint_view(cfg: ModelConfig, names: list[str]) -> tuple[list[str], dict[str, str]]:
    """The text model's tensor names of the checkpoint (unchanged unless the family declares a
    multimodal wrapper's prefixes) and each one's name in the checkpoint; tensors under the
    declaration's `skipped_prefixes` (vision) are left out."""
    decl = declaration(cfg.model_type)
    if not decl.text_prefixes and not decl.skipped_prefixes:
        return names, {}
    renamed: dict[str, str] = {}
    for name in names:
        if name.startswith(decl.skipped_prefixes):
            continue
        new = next(
            (to + name[len(frm) :] for frm, to in decl.text_prefixes if name.startswith(frm)),
            name,
        )
        renamed[new] = name
    return list(renamed), renamed


def renamed(get: Callable[..., Any], source_name: dict[str, str]) -> Callable[..., Any]:
    """`get` (a tensor reader taking the name first) called with each name's checkpoint name."""
    return lambda name, *args: get(source_name.get(name, name), *args)
