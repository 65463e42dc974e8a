"""Speculative decoding: cheap proposals verified by the target model in the ragged step.

1. `SpeculativeConfig` (vLLM's field names) is parsed from `speculative_config=` (a dict or JSON
   string) and rejects bad fields by name.
2. A proposer guesses up to K next tokens of a decoding request: `NgramProposer` (prompt lookup,
   host only) or the draft-model proposer in `jaxinfer.spec_decode.draft` (its own params).
3. The engine core asks the proposer once per step, after the step's tokens are known, and
   stores the guesses on the requests (`jaxinfer.engine.spec`); the next schedule appends what
   fits to each request's decode token as extra query tokens of the same ragged step; the runner
   samples every guessed position with the target model and `rejection.accept` keeps the
   longest agreeing prefix plus one target token.
"""

from jaxinfer.spec_decode.config import SpeculativeConfig
from jaxinfer.spec_decode.ngram import NgramProposer
from jaxinfer.spec_decode.rejection import accept

__all__ = ["NgramProposer", "SpeculativeConfig", "accept"]
