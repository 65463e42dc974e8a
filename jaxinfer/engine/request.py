"""`Request`: one generation's host-side state, owned by the scheduler (no JAX).

1. The engine builds a `Request` (status WAITING) from a prompt and its `SamplingParams` and hands
   it to `Scheduler.add_request`.
2. The scheduler moves it between WAITING and RUNNING and advances `num_computed_tokens` (tokens
   whose K/V are in the cache or being written by a scheduled step) towards `num_tokens` (prompt +
   outputs). There is no prefill or decode phase: a request whose computed tokens lag far behind
   is "prefilling", one that lags by exactly one token (the last sampled one) is "decoding".
3. Each sampled token is appended to `output_token_ids`; when a stop condition fires the status
   becomes one of the FINISHED_* values, `finish_reason` is set and the pages are released.
4. Async scheduling: the scheduler counts a token as soon as a step that samples it is scheduled
   (`num_pending_tokens`, part of `num_tokens`), so the next step can be scheduled before that
   token reaches the host; its id reads as `PENDING_TOKEN` until it is appended (the runner feeds
   it to the next step on the device).

NOTE: `prompt_token_ids` and `output_token_ids` only ever grow at the end (outputs), so any hash
of a leading page of `all_token_ids` stays valid for the request's lifetime.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Sequence

from jaxinfer.engine.page_allocator import salt_root
from jaxinfer.lora.request import LoRARequest
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.vision.inputs import ImageInput, images_salt

# The id `token_slice` gives a sampled token that has not reached the host yet.
PENDING_TOKEN = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)
)

# finish_reason (the OpenAI word) -> terminal status
FINISH_REASONS = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH,
    "abort": RequestStatus.FINISHED_ABORTED,
}


@dataclasses.dataclass(eq=False)
class Request:
    """A prompt, how to sample it, and how far it has got.

    `priority`: lower values are served first, then earlier `arrival_time`.
    `cache_salt`: prefix-cache pages are shared only among requests with the same salt
    (`cache_root`, the first page's parent hash).
    `num_cached_tokens`: prompt tokens served from the prefix cache when first admitted.
    `page_ids`: the page table; page i holds the K/V of tokens [i*page_size, (i+1)*page_size).
    `page_hashes`: prefix-cache chain state of the current page table (see `PageAllocator`); it
    is cleared whenever the page table is released.
    `stop_reason`: the stop token id or stop string that finished it (None for EOS or length).
    `num_pending_tokens`: tokens that scheduled steps sample but whose ids are not yet known.
    `spec_token_ids`: the proposer's draft tokens for the next step (`jaxinfer.engine.spec`);
    the next `schedule` takes what fits and clears them.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    scheduled_time: float | None = None  # first admitted to a running batch (monotonic)
    priority: int = 0
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_pending_tokens: int = 0
    page_ids: list[int] = dataclasses.field(default_factory=list)
    page_hashes: list[int] = dataclasses.field(default_factory=list)
    spec_token_ids: list[int] = dataclasses.field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Set by `Scheduler.add_request` for its hot loops: the output count at which the request
    # finishes by length, and every token id that may stop it (EOS unless ignored, stop ids).
    length_limit: int = 0
    stop_token_set: frozenset[int] = frozenset()
    cache_salt: str | None = None
    cache_root: int = 0
    lora_request: LoRARequest | None = None  # the adapter it runs with
    lora_slot: int = 0  # its pinned device slot while running (0: none; `jaxinfer.lora.slots`)
    # Images whose embeddings replace prompt positions (`jaxinfer.vision`); they salt cache_root.
    mm_inputs: tuple[ImageInput, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"Request.request_id must be a non-empty str, got {self.request_id!r}")
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.eos_token_ids = tuple(self.eos_token_ids)
        lora_id = self.lora_request.lora_int_id if self.lora_request is not None else 0
        self.cache_root = salt_root(images_salt(self.cache_salt, self.mm_inputs), lora_id)
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(
                f"Request {self.request_id!r}: sampling must be SamplingParams, "
                f"got {type(self.sampling).__name__}"
            )

    def prepare(self, max_model_len: int, page_size: int, num_usable_pages: int) -> None:
        """Checks a fresh request against the engine's limits (ValueError naming it) and sets the
        stop-rule fields the scheduler's hot loops read (`length_limit`, `stop_token_set`)."""
        rid, sp = self.request_id, self.sampling
        if self.status is not RequestStatus.WAITING or self.output_token_ids or self.page_ids:
            raise ValueError(f"request {rid!r} is not a fresh WAITING request")
        if not self.prompt_token_ids:
            raise ValueError(f"request {rid!r}: prompt_token_ids is empty")
        if any(not isinstance(t, int) or t < 0 for t in self.prompt_token_ids):
            raise ValueError(f"request {rid!r}: prompt_token_ids must be non-negative ints")
        total = self.num_prompt_tokens + sp.max_tokens
        if total > max_model_len:
            raise ValueError(
                f"request {rid!r}: prompt length {self.num_prompt_tokens} + max_tokens "
                f"{sp.max_tokens} = {total} exceeds max_model_len {max_model_len}"
            )
        self.length_limit = min(sp.max_tokens, max_model_len - self.num_prompt_tokens)
        self.stop_token_set = frozenset(sp.stop_token_ids or ()) | (
            frozenset() if sp.ignore_eos else frozenset(self.eos_token_ids)
        )
        # The last sampled token is never computed, so at most total - 1 tokens hold K/V.
        pages = -(-(total - 1) // page_size)
        if pages > num_usable_pages:
            raise ValueError(
                f"request {rid!r}: prompt length {self.num_prompt_tokens} + max_tokens "
                f"{sp.max_tokens} needs {pages} KV-cache pages, the cache has {num_usable_pages}"
            )

    def append_outputs(self, tokens: list[int]) -> tuple[list[int], tuple[str, int | None] | None]:
        """Appends `tokens` to the outputs one by one under the stop rules until one stops the
        request: (the tokens appended, the stopping one's `stop_reason_of`, or None)."""
        for n, token in enumerate(tokens, 1):
            self.output_token_ids.append(token)
            reason = self.stop_reason_of(token)
            if reason is not None:
                return tokens[:n], reason
        return list(tokens), None

    def stop_reason_of(self, token: int) -> tuple[str, int | None] | None:
        """The stop rules, once `token` is appended: (finish reason, stop id) or None (also when
        `min_tokens` holds a stop back). Stop ids / EOS first, then the length limit."""
        sp, num_out = self.sampling, len(self.output_token_ids)
        if num_out >= sp.min_tokens:
            if sp.stop_token_ids and token in sp.stop_token_ids:
                return "stop", token
            if not sp.ignore_eos and token in self.eos_token_ids:
                return "stop", None
        if num_out >= self.length_limit:
            return "length", None
        return None

    @property
    def may_use_prefix_cache(self) -> bool:
        """False when every token must be computed: prompt logprobs, or penalties (the runner
        counts tokens as it computes them)."""
        sp = self.sampling
        return (
            sp.prompt_logprobs is None
            and sp.repetition_penalty == 1.0
            and sp.frequency_penalty == 0.0
            and sp.presence_penalty == 0.0
        )

    @property
    def may_speculate(self) -> bool:
        """False with penalties (the runner counts output tokens as it computes them, and
        proposed tokens that are rejected must not count) and with token masks (a
        proposal's grammar mask would need the matcher advanced over unverified tokens)."""
        sp = self.sampling
        return (
            sp.repetition_penalty == 1.0
            and sp.frequency_penalty == 0.0
            and sp.presence_penalty == 0.0
            and not sp.masks_tokens
        )

    @property
    def may_burst(self) -> bool:
        """Whether its decodes may run several steps in one program (`jaxinfer.engine.multi_step`):
        not with token masks (the matcher advances per token on the host) or images (M-RoPE
        positions are placed per step)."""
        return not self.sampling.masks_tokens and not self.mm_inputs

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Prompt + outputs that have reached the host."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + outputs, counting the pending ones."""
        return self.num_known_tokens + self.num_pending_tokens

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by the known outputs (a new list on every call)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def known_tokens(self) -> KnownTokens:
        """`all_token_ids` read in place: what the prefix cache hashes a page at a time when a
        request's page fills (no copy of the whole sequence per page)."""
        return KnownTokens(self)

    def known_slice(self, start: int, stop: int) -> list[int]:
        """`all_token_ids[start:stop]` for 0 <= start <= stop without concatenating the whole
        sequence: plain list slices, which end at the known tokens by themselves."""
        prompt = self.prompt_token_ids
        n = len(prompt)
        if stop <= n:
            return prompt[start:stop]
        if start >= n:
            return self.output_token_ids[start - n : stop - n]
        return prompt[start:] + self.output_token_ids[: stop - n]

    def token_slice(self, start: int, stop: int) -> list[int]:
        """`known_slice`, then `PENDING_TOKEN` at the positions of pending tokens."""
        return self.known_slice(start, stop) + [PENDING_TOKEN] * (
            min(stop, self.num_tokens) - max(start, self.num_known_tokens)
        )

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished


class KnownTokens(Sequence):
    """A request's prompt followed by its known outputs, as a read-only sequence over both lists
    (`Request.known_tokens`): slices read `Request.known_slice`."""

    __slots__ = ("_req",)

    def __init__(self, req: Request) -> None:
        self._req = req

    def __len__(self) -> int:
        return len(self._req.prompt_token_ids) + len(self._req.output_token_ids)

    def __getitem__(self, i: int | slice) -> int | list[int]:
        if type(i) is slice:
            start, stop = i.start, i.stop
            # NOTE: the prefix cache's page reads (on the decode step's host path when a page
            # fills) are plain [start:stop] slices: no normalizing
            if not (
                i.step is None and type(start) is int and type(stop) is int and 0 <= start <= stop
            ):
                start, stop, step = i.indices(len(self))
                if step != 1:
                    raise ValueError("KnownTokens slices take step 1")
                stop = max(start, stop)
            return self._req.known_slice(start, stop)
        n, prompt = len(self), self._req.prompt_token_ids
        if not -n <= i < n:
            raise IndexError(f"token {i} of {n}")
        i %= n
        return prompt[i] if i < len(prompt) else self._req.output_token_ids[i - len(prompt)]
