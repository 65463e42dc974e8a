"""`OutputProcessor`: token outputs of the engine core -> text deltas per request and sample.

Runs wherever the tokenizer lives: inside `LLMEngine` (one process) or in a serving front end
whose engine core is another process.

1. `add(parent_id, children)` opens one incremental detokenizer per sample (child request).
2. `process(outputs)` feeds each `TokenOutput`'s ids to its sample's detokenizer and matches the
   sample's stop strings on a tail window of the text (linear in the output length: only text
   that could still hold the start of a match is searched again), holding back text that could
   be the start of a stop string (kept in the text with `include_stop_str_in_output`).
3. It returns the `RequestDelta`s and the samples that a stop string finished: the caller ends
   those in the core (`EngineCore.finish`), which may already have computed a token or two more;
   those are dropped here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxinfer.engine.types import SampleSpec, TokenLogprobs, TokenOutput
from jaxinfer.tokenizer import Tokenizer


@dataclasses.dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    # arrival in the engine core to first scheduled: a measurement, not part of what the request
    # used (two runs of the same request compare equal)
    queue_s: float | None = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass
class RequestDelta:
    """What one step added to one sample of one request."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_text: str
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # on the first delta, when asked
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    usage: Usage | None = None

    def merge(self, later: RequestDelta) -> None:
        """Appends a later delta of the same sample (a stream whose client is behind)."""
        self.new_token_ids += later.new_token_ids
        self.new_text += later.new_text
        if later.logprobs:
            self.logprobs = (self.logprobs or []) + later.logprobs
        if later.prompt_logprobs:
            self.prompt_logprobs = later.prompt_logprobs
        if later.finished:
            self.finished, self.finish_reason, self.usage = True, later.finish_reason, later.usage


class _Sample:
    __slots__ = (
        "parent",
        "index",
        "detok",
        "stop",
        "hold",
        "text",
        "pending",
        "searched",
        "prompt_lps",
        "num_prompt",
        "sent_prompt_lps",
        "want_prompt_lps",
        "num_tokens",
        "include_stop",
        "stop_ids",
    )

    def __init__(self, parent: str, spec: SampleSpec, tokenizer: Tokenizer | None) -> None:
        self.parent, self.index = parent, spec.index
        self.detok = (
            tokenizer.detokenizer(
                spec.prompt_token_ids, skip_special_tokens=spec.skip_special_tokens
            )
            if tokenizer
            else None
        )
        self.include_stop = spec.include_stop_str  # the matched stop string stays in the text
        self.stop_ids = spec.stop_token_ids
        self.stop = [s for s in spec.stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # emitted so far
        self.pending = ""  # detokenized, held back (could be the start of a stop string)
        self.searched = 0  # len(text) when pending was last searched: matches start at >= here
        self.prompt_lps: dict[int, TokenLogprobs] = {}
        self.num_prompt = len(spec.prompt_token_ids)
        self.sent_prompt_lps = False
        self.want_prompt_lps = spec.want_prompt_logprobs
        self.num_tokens = 0  # output tokens delivered

    def feed(self, ids: list[int], finishing: bool) -> tuple[str, str | None, int]:
        """Returns (text to emit now, the stop string that matched or None, how many of `ids`
        count: with several ids (speculative decoding) a stop string completed by one of them
        ends the sample there, exactly as if they had come one per step)."""
        if self.detok is None:
            return "", None, len(ids)
        if self.stop and len(ids) > 1:
            text = ""
            for i, tok in enumerate(ids):
                new, stop, _ = self.feed([tok], finishing and i == len(ids) - 1)
                text += new
                if stop is not None:
                    return text, stop, i + 1
            return text, None, len(ids)
        text_ids = ids
        if finishing and ids and ids[-1] in self.stop_ids and not self.include_stop:
            text_ids = ids[:-1]  # NOTE: the EOS / stop token that ended the sample is no text
        for tok in text_ids:
            self.pending += self.detok.add(tok)
        if finishing:
            self.pending += self.detok.flush()
        return (*self._match(finishing), len(ids))

    def _match(self, finishing: bool) -> tuple[str, str | None]:
        if not self.stop:
            new, self.pending = self.pending, ""
            self.text += new
            return new, None
        # NOTE: everything before `text[-hold:]` was searched already and matched nothing, so
        # a match can only start in the last `hold` emitted characters or in `pending`.
        base = max(0, len(self.text) - self.hold)
        window = self.text[base:] + self.pending
        hits = [(i, s) for s in self.stop if (i := window.find(s)) >= 0]
        if hits:
            i, stop = min(hits)
            cut = base + i - len(self.text)  # chars of pending before the stop string
            new = self.pending[: max(cut + len(stop) if self.include_stop else cut, 0)]
            self.text += new
            self.pending = ""
            return new, stop
        if finishing:
            new, self.pending = self.pending, ""
        else:
            keep = min(self.hold, len(self.pending))
            new, self.pending = (
                self.pending[: len(self.pending) - keep],
                self.pending[len(self.pending) - keep :],
            )
        self.text += new
        return new, None


class OutputProcessor:
    """Per-sample detokenization and stop strings (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._samples: dict[str, _Sample] = {}  # child id -> state
        self._children: dict[str, list[str]] = {}  # parent id -> child ids still open

    def add(self, parent_id: str, children: Sequence[SampleSpec]) -> None:
        self._children[parent_id] = [c.request_id for c in children]
        for c in children:
            self._samples[c.request_id] = _Sample(parent_id, c, self.tokenizer)

    def has(self, child_id: str) -> bool:
        return child_id in self._samples

    @property
    def num_open(self) -> int:
        return len(self._samples)

    def has_parent(self, parent_id: str) -> bool:
        """True while a sample of this request is still open."""
        return parent_id in self._children

    def parents_of(self, child_ids: Sequence[str]) -> list[str]:
        return sorted({self._samples[c].parent for c in child_ids if c in self._samples})

    def drop(self, parent_id: str) -> list[str]:
        """Forgets a parent request (failed); returns its open child ids."""
        children = self._children.pop(parent_id, [])
        for c in children:
            self._samples.pop(c, None)
        return children

    def process(
        self, outputs: Sequence[TokenOutput]
    ) -> tuple[list[RequestDelta], list[tuple[str, str]]]:
        """Returns (deltas, [(child id, stop string)] for samples a stop string finished)."""
        deltas, stopped = [], []
        for o in outputs:
            s = self._samples.get(o.request_id)
            if s is None:
                continue  # finished here (stop string) or failed; the core caught up late
            if o.prompt_logprobs:
                s.prompt_lps.update(o.prompt_logprobs)
            if not o.new_token_ids and not o.finished:
                continue
            new_text, stop, used = s.feed(o.new_token_ids, o.finished)
            s.num_tokens += used
            delta = RequestDelta(s.parent, s.index, list(o.new_token_ids[:used]), new_text)
            if o.logprobs is not None:
                delta.logprobs = list(o.logprobs[:used])
            if s.want_prompt_lps and not s.sent_prompt_lps and o.new_token_ids:
                delta.prompt_logprobs = [None] + [
                    s.prompt_lps.get(p) for p in range(1, s.num_prompt)
                ]
                s.sent_prompt_lps = True
            if stop is not None and not o.finished:
                stopped.append((o.request_id, stop))
            if o.finished or stop is not None:
                delta.finished = True
                delta.finish_reason = "stop" if stop is not None else o.finish_reason
                delta.usage = Usage(s.num_prompt, s.num_tokens, o.num_cached_tokens, o.queue_s)
                self._close(o.request_id, s)
            deltas.append(delta)
        return deltas, stopped

    def _close(self, child_id: str, s: _Sample) -> None:
        del self._samples[child_id]
        siblings = self._children.get(s.parent)
        if siblings is not None and not any(c in self._samples for c in siblings):
            del self._children[s.parent]
