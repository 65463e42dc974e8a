"""Structured output: a grammar per constrained request (llguidance), a token bitmask per step.

1. `grammar_of(params)` turns `StructuredOutputsParams` (JSON schema, any JSON object, regex,
   choice, Lark or GBNF grammar) into an llguidance grammar; `validate(params)` compiles it
   without a tokenizer and raises ValueError naming the field and the problem (front ends call
   it through `check_prompt`, so a bad schema is a 400 / INVALID_ARGUMENT before admission).
2. `StructuredOutputs(tokenizer, vocab_size)` lives in the engine core. `add` proves a request's
   grammar cheap before any step sees it: a worker thread (`GRAMMAR_WORKERS`, off the step
   thread; llguidance releases the GIL) builds its matcher under `LIMITS`, computes its first
   token mask, then that mask again (what each later step pays). `admit()` (each step) returns
   the requests whose proof is done; one that fails to compile, errs, takes more than
   `GRAMMAR_DEADLINE_S` or whose mask costs more than `STEP_MASK_BUDGET_S` is refused
   (`take_rejected`: a message naming the field). `fill(request_ids)` writes each one's
   allowed-token bitmask (bit t of word t // 32 set = token t allowed; llguidance's layout) on
   llguidance's thread pool (the first one is the proof's); `advance` feeds the tokens the
   sampler accepted; `remove` drops it when the request finishes or is aborted. A matcher that
   errs mid-generation (a lexer limit, a token it rejects) is reported by `take_rejected` too:
   that request fails alone with the grammar's error.
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

import dataclasses
import json
import logging
import re
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any

import numpy as np

from jaxinfer.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")

# A grammar's matcher and first token mask must be ready this many seconds after its proof starts
# on a worker, or the request is refused (`(x{1000}){1000}`: 2.4-6 s of mask on one core).
GRAMMAR_DEADLINE_S = 2.0
# The most one mask of a proven grammar may take (its start state's mask, computed again: what
# each step pays for it; ordinary grammars take well under a millisecond).
STEP_MASK_BUDGET_S = 0.1
# Threads proving grammars (a runaway proof holds its thread until llguidance returns).
GRAMMAR_WORKERS = 2
# llguidance's limits, tighter than its defaults where they are generous: lexer states (1-2 kB
# each) per matcher, and no parser state or grammar dumps in error messages (they go to clients).
LIMITS = {"max_lexer_states": 50_000, "verbose_errors": False}


def parser_limits() -> Any:
    """`LIMITS` as an `llguidance.LLParserLimits`."""
    import llguidance as llg

    return llg.LLParserLimits(**LIMITS)


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

    message = llg.LLMatcher.validate_grammar(grammar_of(params), limits=parser_limits())
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


@dataclasses.dataclass
class _Proof:
    """A request whose grammar is being proven cheap on a worker."""

    payload: Any  # what `admit` hands back (the engine core's `Request`)
    field: str
    future: Future
    started: list[float]  # [the monotonic time its worker started] (empty while queued)


class StructuredOutputs:
    """The matchers of an engine core's constrained requests (see the module docstring)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.width = bitmask_width(vocab_size)
        self._lltok: Any = None
        self._executor: Any = None
        self._workers: ThreadPoolExecutor | None = None
        self._matchers: dict[str, Any] = {}
        self._fields: dict[str, str] = {}
        self._first: dict[str, np.ndarray] = {}  # the proof's first mask, used by the first fill
        self._proofs: dict[str, _Proof] = {}
        self._rejected: list[tuple[str, str]] = []
        self.unavailable: str | None = None  # why this tokenizer cannot be constrained

    @property
    def active(self) -> bool:
        """Some request holding a matcher has not finished."""
        return bool(self._matchers)

    @property
    def proving(self) -> bool:
        """Some request's grammar is still being proven (`admit` will hand it over)."""
        return bool(self._proofs)

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
            self._workers = ThreadPoolExecutor(GRAMMAR_WORKERS, thread_name_prefix="grammar")

    def add(self, request_id: str, params: StructuredOutputsParams, payload: Any = None) -> None:
        """Starts proving a request's grammar on a worker; `admit` returns `payload` (default:
        the request id) once it is proven (ValueError if structured output is unavailable)."""
        self.prepare()
        if self._lltok is None or self._workers is None:
            raise ValueError(
                f"structured_outputs: unavailable for this model's tokenizer ({self.unavailable})"
            )
        field, started = _field(params), []
        future = self._workers.submit(self._prove, params, field, started)
        payload = request_id if payload is None else payload
        self._proofs[request_id] = _Proof(payload, field, future, started)

    def _prove(
        self, params: StructuredOutputsParams, field: str, started: list[float]
    ) -> tuple[Any, np.ndarray]:
        """(matcher, first mask row) of a grammar (a worker thread; ValueError naming the
        field). NOTE: llguidance releases the GIL while it builds and masks."""
        import llguidance as llg
        from llguidance.numpy import fill_next_token_bitmask

        started.append(time.monotonic())
        matcher = llg.LLMatcher(
            self._lltok, grammar_of(params), log_level=0, limits=parser_limits()
        )
        rows = np.full((2, self.width), -1, np.int32)
        for k in range(2):
            t0 = time.monotonic()
            if not matcher.is_error():
                fill_next_token_bitmask(matcher, rows, k)
            if matcher.is_error():
                raise ValueError(
                    f"structured_outputs.{field} is invalid: {_first_line(matcher.get_error())}"
                )
        spent = time.monotonic() - t0
        if spent > STEP_MASK_BUDGET_S:
            raise ValueError(
                f"structured_outputs.{field} is too expensive: one token mask takes {spent:.2f} s "
                f"(at most {STEP_MASK_BUDGET_S} s)"
            )
        return matcher, rows[0]

    def admit(self, *, wait: bool = False) -> list[Any]:
        """The payloads whose grammar is proven (their matchers in place); those refused go to
        `take_rejected`. `wait`: first wait until every proof is done or past its deadline (an
        offline engine, which serves nobody else meanwhile)."""
        while wait and any(
            not p.future.done() and not self._late(p) for p in self._proofs.values()
        ):
            futures_wait([p.future for p in self._proofs.values()], 0.01, FIRST_COMPLETED)
        admitted = []
        for rid, proof in list(self._proofs.items()):
            if proof.future.done():
                del self._proofs[rid]
                try:
                    matcher, first = proof.future.result()
                except ValueError as e:
                    self._rejected.append((rid, str(e)))
                    continue
                except Exception as e:  # noqa: BLE001 - llguidance's own errors
                    self._rejected.append(
                        (rid, f"structured_outputs.{proof.field} is invalid: {e}")
                    )
                    continue
                self._matchers[rid], self._first[rid] = matcher, first
                self._fields[rid] = proof.field
                admitted.append(proof.payload)
            elif self._late(proof):
                del self._proofs[rid]  # NOTE: its worker runs on until llguidance returns
                self._rejected.append(
                    (
                        rid,
                        f"structured_outputs.{proof.field} is too expensive: its matcher and "
                        f"first token mask take more than {GRAMMAR_DEADLINE_S} s",
                    )
                )
        return admitted

    @staticmethod
    def _late(proof: _Proof) -> bool:
        return bool(proof.started) and time.monotonic() - proof.started[0] > GRAMMAR_DEADLINE_S

    def take_rejected(self) -> list[tuple[str, str]]:
        """(request id, why) of each request refused or whose matcher erred since the last call."""
        rejected, self._rejected = self._rejected, []
        return rejected

    def remove(self, request_id: str) -> bool:
        """Drops a request's matcher or proof; True if it was still being proven."""
        self._matchers.pop(request_id, None)
        self._first.pop(request_id, None)
        self._fields.pop(request_id, None)
        return self._proofs.pop(request_id, None) is not None

    def advance(self, request_id: str, token_ids: list[int]) -> None:
        """Feeds tokens the sampler chose under this request's masks (a token the matcher
        rejects leaves it in error: the next `fill` reports it)."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return
        self._first.pop(request_id, None)
        for t in token_ids:
            if not matcher.consume_token(t):
                return

    def fill(self, request_ids: list[str]) -> np.ndarray:
        """i32[len(request_ids), width] the next-token bitmask of each request (all ones for
        one without a matcher). A matcher in error is dropped and reported (`take_rejected`)."""
        from llguidance.numpy import fill_next_token_bitmask_par

        bitmask = np.full((len(request_ids), self.width), -1, np.int32)
        rows = []
        for i, rid in enumerate(request_ids):
            first = self._first.pop(rid, None)
            if first is not None:
                bitmask[i] = first
            elif rid in self._matchers:
                rows.append((self._matchers[rid], i))
        if rows:
            fill_next_token_bitmask_par(self._executor, rows, bitmask)
            for matcher, i in rows:
                if matcher.is_error():
                    rid = request_ids[i]
                    why = _first_line(matcher.get_error())
                    self._rejected.append(
                        (rid, f"structured_outputs.{self._fields[rid]}: the grammar failed: {why}")
                    )
                    logger.error("request %s: its grammar failed: %s", rid, why)
                    self.remove(rid)
        return bitmask


def _first_line(error: str) -> str:
    lines = (error or "").strip().splitlines()
    return lines[0] if lines else "no reason given"


def allowed_ids(bitmask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """i32[k] the token ids a bitmask row allows (tests, the fake runner)."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask_row).view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size]).astype(np.int32)
