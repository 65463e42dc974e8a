"""The Hugging Face transformers peer for benchmarks: the same GGUF weights in a torch model."""

from __future__ import annotations

import os
from typing import Any

import numpy as np


def hf_model_from_gguf(path: str) -> tuple[Any, dict] | None:
    """(LlamaForCausalLM in f32 with our dequantized weights, its config dict), or None when
    torch/transformers are not installed. torch uses every core."""
    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return None
    from checkpoints.gguf import read_gguf

    torch.set_num_threads(os.cpu_count() or 1)
    ck = read_gguf(path)
    hf = ck.hf_config()
    model = LlamaForCausalLM(LlamaConfig(**hf)).float().eval()
    state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in ck.tensors()}
    if hf.get("tie_word_embeddings"):
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state)
    return model, hf
