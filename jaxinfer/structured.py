"""Structured output: a grammar per constrained request (llguidance), a token bitmask per step.

1. `grammar_of(params)` turns `StructuredOutputsParams` (JSON schema, any JSON object, regex,
   choice, Lark or GBNF grammar) into an llguidance grammar; `validate(params)` compiles it
   without a tokenizer and raises ValueError naming the field and the problem (front ends call
   it through `check_prompt`, so a bad schema is a 400 / INVALID_ARGUMENT before admission).
2. `StructuredOutputs(tokenizer, vocab_size)` lives in the engine core: `add` builds a request's
   matcher, `fill(request_ids, bitmask)` writes each one's allowed-token bitmask (bit t of word
   t // 32 set = token t allowed; llguidance's layout) on llguidance's thread pool, which
   releases the GIL; `advance` feeds the tokens the sampler accepted; `remove` drops it when the
   request finishes or is aborted.
3. The runner passes the bitmask rows to the jitted sampler as one `i32[S, ceil(V/32)]` array
   (`jaxinfer.sampling.sample(token_bitmask=...)`); unconstrained rows are all ones (-1), so the
   program, its shapes and unconstrained rows are the same whether or not a row is constrained.

NOTE: the matcher state depends only on the output tokens accepted so far, so a preempted
request (recomputed from its prompt and outputs) and a prefix-cache hit need nothing: the next
mask is the matcher's current one.
NOTE: a request's mask needs the token sampled just before. A step that samples constrained rows
therefore runs as two programs (`ModelRunner.launch(defer_sampling=True)`, then `sample`): the
engine core launches the forward, lands the step before (its tokens `advance` the matchers),
`fill`s the masks while the device runs the forward, then launches the sampler; async scheduling
stays on (see `EngineCore.step`).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import numpy as np

from jaxinfer.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def bitmask_width(vocab_size: int) -> int:
    """32-bit words of one row's token bitmask."""
    return (vocab_size + 31) // 32


def _field(params: StructuredOutputsParams) -> str:
    for f in ("json", "regex", "choice", "grammar"):
        if getattr(params, f) is not None:
            return f
    return "json_object"


def grammar_of(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (ValueError naming the field when malformed)."""
    import llguidance as llg

    field = _field(params)
    if field == "json":
        schema = params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(
                f"structured_outputs.json must be a JSON schema object, got {type(schema).__name__}"
            )
        try:
            return llg.LLMatcher.grammar_from_json_schema(schema)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json: {e}") from None
    if field == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"})
    if field == "regex":
        return llg.LLMatcher.grammar_from_regex(params.regex)
    if field == "choice":
        # NOTE: a JSON string literal is a Lark string literal with the same escapes.
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
        return llg.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        lark = any_to_lark(params.grammar)  # GBNF / EBNF (`root ::= ...`) or Lark as it is
    except Exception as e:  # noqa: BLE001 - the converter raises its own error types
        raise ValueError(f"structured_outputs.grammar is invalid: {e}") from None
    return llg.LLMatcher.grammar_from_lark(lark)


def validate(params: StructuredOutputsParams) -> None:
    """Raises ValueError naming the field and the problem if the constraint does not compile."""
    import llguidance as llg

    message = llg.LLMatcher.validate_grammar(grammar_of(params))
    if message and not message.startswith("WARNING"):
        raise ValueError(f"structured_outputs.{_field(params)} is invalid: {message.strip()}")


class _PieceTable:
    """llguidance's tokenizer interface from each token's bytes, read off its vocabulary piece:
    SentencePiece pieces ("\u2581the", "<0x0A>") or byte-level BPE ones ("\u0120the")."""

    def __init__(self, tokenizer: Any) -> None:
        from jaxinfer.tokenizer.gguf_vocab import byte_level_alphabet

        self.eos_token_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(tokenizer.special_token_ids)
        pieces = [tokenizer.id_to_piece(i) for i in range(tokenizer.vocab_size)]
        byte_of = {c: b for b, c in byte_level_alphabet().items()}
        byte_level = any("\u0120" in p for p in pieces) and not any("\u2581" in p for p in pieces)
        self.tokens = []
        for i, piece in enumerate(pieces):
            byte = _BYTE_PIECE.match(piece)
            if byte:
                self.tokens.append(bytes([int(byte.group(1), 16)]))
            elif i in tokenizer.special_token_ids:
                self.tokens.append(piece.encode())
            elif byte_level and all(c in byte_of for c in piece):
                self.tokens.append(bytes(byte_of[c] for c in piece))
            else:
                self.tokens.append(piece.replace("\u2581", " ").encode())
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


def llguidance_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """An `llguidance.LLTokenizer` over our `Tokenizer` (~1 s: build once per engine)."""
    import llguidance as llg

    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens, more than the model's "
            f"vocab_size={vocab_size}"
        )
    eos = list(tokenizer.eos_token_ids) or None
    backend = getattr(tokenizer, "_backend", None)
    hf = getattr(backend, "tok", None)
    if hf is not None and hasattr(
        hf, "to_str"
    ):  # a `tokenizers.Tokenizer` (tokenizer.json, GGUF BPE)
        try:
            return llg.LLTokenizer(hf.to_str(), n_vocab=vocab_size, eos_token=eos)
        except ValueError as e:  # e.g. no decoder: llguidance cannot tell how tokens spell bytes
            logger.info(
                "llguidance cannot read %s's tokenizer.json (%s); using its pieces",
                tokenizer.source,
                e,
            )
    from llguidance._tokenizer import TokenizerWrapper

    return llg.LLTokenizer(
        TokenizerWrapper(_PieceTable(tokenizer)), n_vocab=vocab_size, eos_token=eos
    )


class StructuredOutputs:
    """The matchers of an engine core's constrained requests (see the module docstring)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.width = bitmask_width(vocab_size)
        self._lltok: Any = None
        self._executor: Any = None
        self._matchers: dict[str, Any] = {}
        self.unavailable: str | None = None  # why this tokenizer cannot be constrained

    @property
    def active(self) -> bool:
        """Some request holding a matcher has not finished."""
        return bool(self._matchers)

    def has(self, request_id: str) -> bool:
        return request_id in self._matchers

    def prepare(self) -> None:
        """Builds the llguidance tokenizer and thread pool now (else on the first request). A
        tokenizer llguidance cannot read leaves the engine serving: `unavailable` says why, and
        constrained requests raise it."""
        import llguidance as llg

        if self._lltok is None and self.unavailable is None:
            try:
                self._lltok = llguidance_tokenizer(self.tokenizer, self.vocab_size)
            except Exception as e:  # noqa: BLE001 - only constrained requests need it
                self.unavailable = f"{type(e).__name__}: {e}"
                logger.warning(
                    "structured output is unavailable for %s: %s",
                    self.tokenizer.source,
                    self.unavailable,
                )
                return
            self._executor = llg.LLExecutor()

    def add(self, request_id: str, params: StructuredOutputsParams) -> None:
        import llguidance as llg

        self.prepare()
        if self._lltok is None:
            raise ValueError(
                f"structured_outputs: unavailable for this model's tokenizer ({self.unavailable})"
            )
        matcher = llg.LLMatcher(self._lltok, grammar_of(params), log_level=0)
        if matcher.is_error():
            raise ValueError(
                f"structured_outputs.{_field(params)} is invalid: {matcher.get_error()}"
            )
        self._matchers[request_id] = matcher

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def advance(self, request_id: str, token_ids: list[int]) -> None:
        """Feeds tokens the sampler chose under this request's masks."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return
        for t in token_ids:
            if not matcher.consume_token(t):
                why = (matcher.get_error() or "").strip().splitlines()[:1]
                logger.error(
                    "request %s: token %d rejected by its grammar (%s)",
                    request_id,
                    t,
                    why[0] if why else "no reason given",
                )
                return

    def fill(self, request_ids: list[str]) -> np.ndarray:
        """i32[len(request_ids), width] the next-token bitmask of each request (all ones for
        one without a matcher)."""
        from llguidance.numpy import fill_next_token_bitmask_par

        bitmask = np.full((len(request_ids), self.width), -1, np.int32)
        rows = [(self._matchers[r], i) for i, r in enumerate(request_ids) if r in self._matchers]
        if rows:
            fill_next_token_bitmask_par(self._executor, rows, bitmask)
        return bitmask


def allowed_ids(bitmask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """i32[k] the token ids a bitmask row allows (tests, the fake runner)."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask_row).view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size]).astype(np.int32)
