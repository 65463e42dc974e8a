"""`SpeculativeConfig`: what `speculative_config=` / `serve.py --speculative-config JSON` accept.

1. `SpeculativeConfig.parse(value)` takes None, a dict, a JSON object string or a config.
2. Field names are vLLM's: `method` ("ngram" | "draft_model"), `num_speculative_tokens` (K),
   `prompt_lookup_min` / `prompt_lookup_max` (n-gram sizes), `model` (the draft model's path),
   plus `disable_by_batch_size` (the back-off rule, see `Scheduler`).
3. Every bad field raises ValueError naming `speculative_config.<field>` (no JAX imported).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

METHODS = ("ngram", "draft_model")
DEFAULT_DISABLE_BY_BATCH_SIZE = 4  # see BENCHMARKS.md: verification stops paying above this


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """How to propose and how many tokens per step (see the module docstring).

    `disable_by_batch_size`: a step speculates only while at most this many requests are running
    or waiting; above it verification (K + 1 scored positions per request) costs more compute
    than the serial steps it saves.
    `draft_num_layers`: with method "draft_model", keep only the first N decoder layers of the
    draft checkpoint (None: all), so the target's own checkpoint truncated is a draft.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    model: str | None = None
    draft_num_layers: int | None = None
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"speculative_config.{name}: {why}, got {getattr(self, name)!r}")

        if self.method not in METHODS:
            raise bad("method", f"must be one of {list(METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 32:
            raise bad("num_speculative_tokens", "must be an integer in [1, 32]")
        for name in ("prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad(name, "must be an integer >= 1")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise bad("prompt_lookup_min", f"must be <= prompt_lookup_max={self.prompt_lookup_max}")
        if self.method == "draft_model":
            if not self.model or not isinstance(self.model, str):
                raise bad("model", "method 'draft_model' needs the draft checkpoint's path")
        elif self.model is not None:
            raise bad("model", "is only used by method 'draft_model'")
        n = self.draft_num_layers
        if n is not None and (self.method != "draft_model" or not isinstance(n, int) or n < 1):
            raise bad("draft_num_layers", "must be an integer >= 1 with method 'draft_model'")

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """None, a dict, a JSON object string or a `SpeculativeConfig` -> a config (or None)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(
                f"speculative_config must be a dict or a JSON object, got {type(value).__name__}"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown field(s) {unknown}; known: {sorted(known)}"
            )
        for name in ("method", "num_speculative_tokens"):
            if name not in value:
                raise ValueError(f"speculative_config.{name} is required")
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
