"""Streaming detokenizers: generated ids in, text deltas out, never half a UTF-8 character.

1. `IncrementalDetokenizer` (SentencePiece vocabularies) decodes a short window of recent ids
   twice (with and without the newest ones) and releases the difference only when it does not end
   in U+FFFD, so a character split over several byte tokens is held back until complete.
2. `StreamDetokenizer` (`tokenizers` vocabularies) gives the same contract over the library's
   `DecodeStream`, one incremental decode per token.
A few prompt ids seed both, so SentencePiece's "▁" on the first generated token reads as the space
it is rather than being stripped as the start of a text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenizers import decoders

if TYPE_CHECKING:
    from jaxinfer.tokenizer.core import Tokenizer

_DETOKENIZER_PROMPT_CONTEXT = 6


class IncrementalDetokenizer:
    """Streams the text of generated ids, never releasing half a UTF-8 character.

    NOTE: the concatenation of everything `add` and `flush` return equals
    `decode(prompt_ids[-k:] + generated)` minus `decode(prompt_ids[-k:])` for a few prompt ids k,
    which is `decode(generated)` when there is no prompt; with a prompt it keeps the space a
    SentencePiece "▁" puts before the first generated word.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_ids)[-_DETOKENIZER_PROMPT_CONTEXT:] if len(prompt_ids) else []
        # The decode window: ids[:read] are already released (they give context), the rest wait.
        self._ids: list[int] = tokenizer._check_ids(context)
        self._read = len(self._ids)
        self._released_text = self._decode(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Feed one generated id; return the text it completes (often "", never half a character)."""
        self._ids.extend(self._tokenizer._check_ids([token_id]))
        return self._release(final=False)

    def flush(self) -> str:
        """Return whatever is still held back (incomplete bytes come out as U+FFFD)."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        text = self._decode(self._ids)
        if len(text) <= len(self._released_text) or (not final and text.endswith("\ufffd")):
            return ""
        delta = text[len(self._released_text) :]
        # Slide the window: the ids just released become the context for the next ones.
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._released_text = self._decode(self._ids)
        return delta


class StreamDetokenizer:
    """`IncrementalDetokenizer`'s contract over `tokenizers.decoders.DecodeStream`.

    The stream starts from the last few prompt ids (so a first word keeps its leading space);
    ids that do not complete a character yet are remembered, so `flush` can release them as
    U+FFFD when the request ends.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._tok = tokenizer._backend.tok
        self._skip = skip_special_tokens
        context = tokenizer._check_ids(list(prompt_ids)[-_DETOKENIZER_PROMPT_CONTEXT:])
        self._stream = decoders.DecodeStream(context, skip_special_tokens=skip_special_tokens)
        self._held: list[int] = []  # ids fed since the last text came out

    def add(self, token_id: int) -> str:
        """Feed one generated id; return the text it completes (often "", never half a character)."""
        (tid,) = self._tokenizer._check_ids([token_id])
        text = self._stream.step(self._tok, tid)
        if text is None:
            self._held.append(tid)
            return ""
        self._held.clear()
        return text

    def flush(self) -> str:
        """Return whatever is still held back (incomplete bytes come out as U+FFFD)."""
        held, self._held = self._held, []
        return self._tok.decode(held, skip_special_tokens=self._skip) if held else ""
