"""The engine core's start-up report: how many tokens the KV cache holds and how it is laid out
(`log_capacity`, called once by `EngineCore.__init__`), and the scheduling options the engine
runs with (the served tests read them to see that serve.py's flags reached the core)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from jaxinfer import sharding as shd

if TYPE_CHECKING:
    from jaxinfer.engine.core import EngineCore

logger = logging.getLogger("jaxinfer.engine.core")


def log_capacity(core: EngineCore, data: int, shards: int, gain: float) -> None:
    """Logs what the KV cache holds and how it is laid out over the mesh (once, at start)."""
    usable = sum(a.num_usable_pages for a in core.allocators)
    held = core.runner.bytes_per_device()
    c = core.config
    if core.cfg.is_mla:  # one latent row per token, shared by all heads
        replicated = f"; MLA latent rows whole on each of the {shards} attention shard(s)"
    elif shd.kv_heads_split(core.cfg.num_kv_heads, shards):
        replicated = ""
    else:
        replicated = (
            f"; KV replicated: {core.cfg.num_kv_heads} KV heads < {shards} attention shards, each "
            f"shard keeps a copy of the one its query heads need"
        )
    logger.info(
        "KV cache (%s): %d pages x %d tokens = %d tokens (%.1f MiB); max_model_len %d -> up to "
        "%.1f concurrent full-length requests; max_num_seqs %d, max_num_batched_tokens %d; mesh "
        "%s: %d data replica(s) of %d pages, per device %.1f MiB params + %.1f MiB KV%s",
        _kv_storage(core, gain),
        usable,
        c.page_size,
        usable * c.page_size,
        core.runner.kv_cache_bytes / 2**20,
        core.max_model_len,
        usable * c.page_size / core.max_model_len,
        c.max_num_seqs,
        c.max_num_batched_tokens,
        c.mesh or "single device",
        data,
        core.allocators[0].num_pages,
        held["params"] / 2**20,
        held["kv_cache"] / 2**20,
        replicated,
    )
    logger.info(
        "scheduling %s; prefix caching %s; long_prefill_token_threshold %s; speculative %s; "
        "num_scheduler_steps %d",
        "async" if c.async_scheduling else "sync",
        "on" if c.enable_prefix_caching else "off",
        c.long_prefill_token_threshold,
        getattr(c.speculative_config, "method", "off"),
        c.num_scheduler_steps,
    )
    if getattr(core.runner, "images", None) is not None:
        logger.info(
            "images: max_num_encoder_input_tokens %d a step; an image's tokens attend to each "
            "other (one chunk each)",
            core.scheduler.max_num_encoder_input_tokens,
        )


def _kv_storage(core: EngineCore, gain: float) -> str:
    """How the cache is stored, and for fp8 the token capacity `gain` over the model dtype."""
    if core.config.kv_cache_dtype != "fp8":
        return core.config.dtype
    return (
        f"fp8 e4m3 + one exponent byte per {core.cfg.head_dim}-value row: "
        f"{gain:.2f}x the tokens of {core.config.dtype} in the same memory"
    )
