"""The proposer an engine core speculates with, built from its `SpeculativeConfig`.

`make_proposer` returns an `NgramProposer` (host only) or a `draft.DraftProposer` (its own model,
loaded here unless given). Every proposer has `propose_batch([(request, k), ...])` (up to k draft
ids per request; the engine core calls it once per step, after the step's tokens are known, and
the scheduler may keep a prefix of each) and `warmup()`.
"""

from __future__ import annotations

from typing import Any

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.spec_decode.config import SpeculativeConfig
from jaxinfer.spec_decode.ngram import NgramProposer


def make_proposer(
    spec: SpeculativeConfig | None,
    cfg: ModelConfig,
    config: EngineConfig,
    draft: Any,
    **backends: str | None,
) -> Any:
    """The proposer of `spec` (None: off), what the engine core asks for draft tokens. The
    draft model is `draft` (a `LoadedModel`) when given, else loaded from
    `speculative_config.model`; `backends` are the target's attention / linear backends."""
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    from jaxinfer.spec_decode.draft import DraftProposer, truncate

    if draft is None:
        from jaxinfer.loader import load_model

        draft = load_model(spec.model, dtype=config.dtype)
    dcfg, dparams = draft.cfg, draft.params
    if dcfg.vocab_size != cfg.vocab_size:
        raise ValueError(
            f"speculative_config.model: the draft's vocabulary has {dcfg.vocab_size} "
            f"tokens, the target's {cfg.vocab_size}"
        )
    if spec.draft_num_layers is not None:
        dcfg, dparams = truncate(dcfg, dparams, spec.draft_num_layers)
    return DraftProposer(
        dcfg,
        dparams,
        num_speculative_tokens=spec.num_speculative_tokens,
        page_size=config.page_size,
        num_pages=config.num_pages,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        token_buckets=config.token_buckets,
        dtype=config.dtype,
        **backends,
    )
