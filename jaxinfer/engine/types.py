"""The engine's contract: what the front end, the engine core and the runner hand each other.

Plain data only: this module imports no JAX (a test enforces it), so a serving front end that
imports only this (and the tokenizer and config) never loads JAX.

1. Requests in: `CoreRequest` (one sample of one request, ids only; `split_samples` turns a
   request of n samples into n of them plus the output processor's `SampleSpec`s), checked by
   `limits.check_prompt` against the core's `EngineLimits`.
2. Scheduler -> runner -> scheduler: `SchedulerOutput` (a diff of `ScheduledRequest`s against the
   runner's persistent batch) -> `RunnerOutput` (sampled ids, `TokenLogprobs`) -> the scheduler's
   `RequestUpdate`s; `Launched` is a step on the device not fetched yet; `Runner` names what the
   engine core and the multi-host leader call on a runner.
3. Core -> front end: `TokenOutput` per request per step; `EngineStats` (per step), `EngineInfo`
   and `EngineCapacity` (at start) are typed records.
4. The wire between a front end and an engine-core process: typed messages (NamedTuples whose
   first field is their tag: msgpack packs them as lists as they are), `encode`d where a field
   needs it (logprobs) and `decode_message`d back into the same types on the other side.
     front end -> core: AddRequests  Abort  Finish  Shutdown  RemoveLoRA  StartProfile  StopProfile
     core -> front end: Loaded  Ready  Broken  StepResult
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from jaxinfer.engine.limits import EngineLimits
from jaxinfer.lora.request import LoRARequest
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.vision.inputs import ImageInput

if TYPE_CHECKING:
    from jaxinfer.engine.request import Request

# `new_tuple(TokenOutput, (...))`: a NamedTuple made in one C call, without its Python __new__
# (the hot loops of the scheduler, `step_update` and `token_outputs`)
new_tuple = tuple.__new__


@dataclasses.dataclass
class CoreRequest:
    """One sample of one request, as the core sees it (ids only)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0
    cache_salt: str | None = None  # prefix-cache pages shared only under the same salt
    lora_request: LoRARequest | None = None  # the adapter it runs with (enable_lora)
    mm_inputs: tuple[ImageInput, ...] = ()  # images over prompt positions (`jaxinfer.vision`)


@dataclasses.dataclass
class SampleSpec:
    """One child request of a parent: what the output processor needs to turn its ids into text."""

    request_id: str  # the child's id in the core
    index: int  # sample index within the parent
    prompt_token_ids: Sequence[int]
    stop: Sequence[str] = ()
    want_prompt_logprobs: bool = False
    include_stop_str: bool = False  # the matched stop string stays in the text
    skip_special_tokens: bool = True
    # EOS (unless ignored) and `stop_token_ids`: the one that ends the sample is not text (vLLM)
    stop_token_ids: frozenset[int] = frozenset()


def split_samples(
    request_id: str,
    ids: list[int],
    sampling: SamplingParams,
    *,
    eos_token_ids: tuple[int, ...],
    priority: int = 0,
    cache_salt: str | None = None,
    lora_request: LoRARequest | None = None,
    mm_inputs: tuple[ImageInput, ...] = (),
) -> tuple[list[CoreRequest], list[SampleSpec]]:
    """One request of `n` samples -> n child requests for the core and n specs for the output
    processor (child ids `rid#i` when n > 1, seeds spread so samples differ)."""
    core, specs = [], []
    for i in range(sampling.n):
        child_sp = sampling
        if sampling.n > 1 and sampling.seed is not None:
            child_sp = dataclasses.replace(sampling, seed=(sampling.seed + 7919 * i) % 2**63)
        cid = request_id if sampling.n == 1 else f"{request_id}#{i}"
        core.append(
            CoreRequest(
                cid,
                list(ids),
                child_sp,
                eos_token_ids,
                priority,
                cache_salt,
                lora_request,
                tuple(mm_inputs),
            )  # fmt: skip
        )
        specs.append(
            SampleSpec(
                cid,
                i,
                ids,
                list(sampling.stop or []),
                sampling.prompt_logprobs is not None,
                sampling.include_stop_str_in_output,
                sampling.skip_special_tokens,
                frozenset(sampling.stop_token_ids or ())
                | (frozenset() if sampling.ignore_eos else frozenset(eos_token_ids)),
            )
        )
    return core, specs


@dataclasses.dataclass
class TokenLogprobs:
    """Logprob of one chosen token plus the top-k alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    top: dict[int, float]


class TokenOutput(NamedTuple):
    """What one step added to one child request (a tuple: built once per request per step, with
    `new_tuple` in the hot loop, and sent as a list)."""

    request_id: str
    new_token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when asked
    prompt_logprobs: dict[int, TokenLogprobs] | None = None  # position -> logprobs, when asked
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    queue_s: float | None = None  # (finished only) arrival in the core to first scheduled


def _lp_wire(lp: TokenLogprobs | None) -> list | None:
    return None if lp is None else [lp.token_id, lp.logprob, list(lp.top.items())]


def _lp_unwire(w: list | None) -> TokenLogprobs | None:
    return None if w is None else TokenLogprobs(w[0], w[1], dict(w[2]))


def to_wire(out: TokenOutput) -> TokenOutput | list:
    """A msgpack-able form of `out` (itself unless it carries logprobs)."""
    if out.logprobs is None and out.prompt_logprobs is None:
        return out
    plp = (
        None
        if out.prompt_logprobs is None
        else [[p, _lp_wire(lp)] for p, lp in out.prompt_logprobs.items()]
    )
    lps = None if out.logprobs is None else [_lp_wire(lp) for lp in out.logprobs]
    return [
        out.request_id,
        out.new_token_ids,
        lps,
        plp,
        out.finished,
        out.finish_reason,
        out.stop_reason,
        out.num_prompt_tokens,
        out.num_output_tokens,
        out.num_cached_tokens,
    ]


def from_wire(w: list) -> TokenOutput:
    plp = None if w[3] is None else {p: _lp_unwire(lp) for p, lp in w[3]}
    lps = None if w[2] is None else [_lp_unwire(lp) for lp in w[2]]
    return TokenOutput(w[0], list(w[1]), lps, plp, *w[4:])


def request_to_wire(r: CoreRequest) -> list:
    return [
        r.request_id,
        r.prompt_token_ids,
        dataclasses.asdict(r.sampling),
        list(r.eos_token_ids),
        r.priority,
        r.cache_salt,
        None if r.lora_request is None else dataclasses.astuple(r.lora_request),
        [im.to_wire() for im in r.mm_inputs],
    ]


def request_from_wire(w: list) -> CoreRequest:
    lora = None if w[6] is None else LoRARequest(*w[6])
    mm = tuple(ImageInput.from_wire(x) for x in w[7])
    return CoreRequest(w[0], list(w[1]), SamplingParams(**w[2]), tuple(w[3]), w[4], w[5], lora, mm)


class ScheduledRequest(NamedTuple):
    """One request's share of a step, as a diff against what the runner already holds.

    A request that (re)joins the batch (`is_new`: first scheduled since admission or resumption)
    comes with its whole page table in `new_page_ids`; a running one only with the pages allocated
    for this step (usually none). The runner keeps each row's page table and sampling parameters
    between steps and patches them from these diffs.

    NOTE: a tuple (immutable): the scheduler's hot loop builds one per running request per step
    with `new_tuple` (one C call), and the runner reads a whole step's fields column by column
    with one `zip(*scheduled)`.
    """

    request: Request
    token_ids: list[int]  # all_token_ids[start_pos : ...], then num_spec_tokens proposed ones
    start_pos: int  # num_computed_tokens before this step
    new_page_ids: Sequence[int]  # pages the runner has not seen (the whole table when is_new)
    sample: bool  # the chunk reaches the end of the known tokens: sample one new token
    replica: int = 0  # data replica whose pages (ids local to its pool) hold the request
    is_new: bool = False  # the request (re)joins the batch: its row is built from scratch
    # NOTE: the request's live page list, not a copy: it only grows at the end while the request
    # holds it (a release swaps in a new list), so its first cdiv(start_pos + len(token_ids),
    # page_size) pages stay this step's table.
    page_table: Sequence[int] = ()
    # Speculative decoding: the last `num_spec_tokens` of `token_ids` are proposed tokens (not
    # the request's own); the runner verifies them (`RunnerOutput.accepted_draft_ids`).
    num_spec_tokens: int = 0

    @property
    def is_decode(self) -> bool:
        return (
            self.sample
            and len(self.token_ids) == 1
            and self.start_pos >= self.request.num_prompt_tokens
        )


_NUM_SPEC_TOKENS = operator.attrgetter("num_spec_tokens")


@dataclasses.dataclass
class SchedulerOutput:
    # NOTE: decodes (1 token, sample=True, past the prompt) first, then prefill chunks.
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    preempted: list[str]  # request ids preempted this step: drop their per-request state
    finished: list[str]  # request ids finished or aborted since the last schedule()
    # Structured output (filled by the engine core): request id -> its row of `token_bitmask`,
    # i32[len(bitmask_rows), ceil(V / 32)] the tokens each may sample this step.
    bitmask_rows: dict[str, int] = dataclasses.field(default_factory=dict)
    token_bitmask: Any = None
    # (slot, adapter) pairs the runner loads before this step (`jaxinfer.lora.slots`)
    lora_loads: list[tuple[int, LoRARequest]] = dataclasses.field(default_factory=list)
    # lora_int_ids unloaded since the last schedule: the runner drops their host copies
    lora_removes: list[int] = dataclasses.field(default_factory=list)
    # Multi-step scheduling (`EngineConfig.num_scheduler_steps`): every scheduled request is a
    # decode and one program runs this many steps of them, each feeding the ids it sampled to the
    # next; each request holds pages for its tokens of all of them and gets that many ids back
    # (`RunnerOutput.step_token_ids`).
    num_steps: int = 1

    @property
    def num_decodes(self) -> int:
        return sum(1 for s in self.scheduled if s.is_decode)

    @property
    def num_spec_tokens(self) -> int:
        """Proposed tokens this step verifies (its results must reach the host before the next
        schedule: a speculating step runs synchronously)."""
        return sum(map(_NUM_SPEC_TOKENS, self.scheduled))


@dataclasses.dataclass
class RunnerOutput:
    sampled_token_ids: dict[str, int]  # every scheduled request with sample=True
    logprobs: dict[str, TokenLogprobs] = dataclasses.field(default_factory=dict)
    # request id -> {prompt position -> logprobs}
    prompt_logprobs: dict[str, dict[int, TokenLogprobs]] = dataclasses.field(default_factory=dict)
    # Speculative steps: request id -> the proposed tokens accepted before its sampled token
    # (a prefix of its proposals), and their logprobs when asked (one per accepted token; in a
    # multi-step step, those of the ids before the sampled one, `step_token_ids`).
    accepted_draft_ids: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    draft_logprobs: dict[str, list[TokenLogprobs]] = dataclasses.field(default_factory=dict)
    # Multi-step steps (`SchedulerOutput.num_steps` > 1): request id -> the id each of the
    # program's steps sampled, in order (`sampled_token_ids` holds the last).
    step_token_ids: dict[str, list[int]] = dataclasses.field(default_factory=dict)


class RequestUpdate(NamedTuple):
    """One request's tokens from one step (a tuple: the hot loops build it with `new_tuple`,
    one C call, and unpack it)."""

    request: Request
    new_token_ids: list[int]
    finished: bool


@dataclasses.dataclass
class SpecStats:
    """Speculative-decoding counters since start (requests verified while still running)."""

    num_spec_steps: int = 0  # (request, step) pairs that verified proposals
    num_draft_tokens: int = 0  # tokens proposed
    num_accepted_tokens: int = 0  # proposed tokens accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verifying (request, step): accepted proposals + 1."""
        return 1.0 + self.num_accepted_tokens / self.num_spec_steps if self.num_spec_steps else 0.0


@dataclasses.dataclass
class Launched:
    """A step running on the device (`Runner.launch`): its results, not yet fetched."""

    sched: SchedulerOutput
    results: Any  # device arrays: (sampled ids, sampler output or None, prompt logprobs or None)
    plan: Any
    # Launched with `defer_sampling` and not sampled yet: (row logits, prompt logprobs, Prepared)
    deferred: Any = None


class Runner(Protocol):
    """What `EngineCore` (and `multihost.LeaderRunner`) call on a runner: `ModelRunner`, the
    multi-host leader's wrapper of one, and `serving.testing.FakeRunner` implement it.

    `execute` is one whole step; `launch` + `collect` the same split around the next step's
    scheduling (async scheduling: only when not `synchronous_only`), `launch(defer_sampling=True)`
    + `sample` + `collect` a step whose structured-output masks are filled while its forward runs
    (only with `split_sampling`).
    """

    attention_backend: str
    linear_backend: str
    num_compiled: int  # programs built so far
    split_sampling: bool  # `launch(defer_sampling=True)` / `sample` work

    @property
    def synchronous_only(self) -> bool:
        """Every step must be `execute`d (a multi-host leader: followers run each step with it)."""
        ...

    def execute(self, sched: SchedulerOutput) -> RunnerOutput: ...

    def launch(
        self, sched: SchedulerOutput, *, defer_sampling: bool = False
    ) -> Launched | None: ...

    def sample(self, launched: Launched) -> None: ...

    def collect(self, launched: Launched) -> RunnerOutput: ...

    def warmup(self, *, structured: bool = False) -> int: ...

    def bytes_per_device(self) -> dict[str, int]:
        """Parameter and KV-cache bytes held by the first device."""
        ...


class EngineCapacity(NamedTuple):
    """The KV cache over every data replica."""

    num_pages: int
    page_size: int
    max_tokens: int  # num_pages * page_size
    max_model_len: int


class EngineStats(NamedTuple):
    """Load numbers over every data replica (what serving reports and logs); `spec_*` are
    speculative-decoding counters since start (acceptance rate = accepted / draft tokens, mean
    accepted length = 1 + accepted / spec steps)."""

    running: int = 0
    waiting: int = 0
    pages_total: int = 0
    pages_used: int = 0
    compiled_programs: int = 0
    steps: int = 0
    generated: int = 0
    spec_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    step_s: float | None = None  # host time of the step this message reports (None: no step)
    preemptions: int = 0  # requests preempted since start (every replica)
    lora: list | None = None  # enable_lora: [max_loras, running, waiting] (`Scheduler.lora_info`)


class EngineInfo(NamedTuple):
    """Static facts a front end reports (msgpack-able as a list)."""

    capacity: EngineCapacity
    limits: EngineLimits
    max_num_seqs: int
    max_num_batched_tokens: int
    page_size: int
    dtype: str
    quantization: str | None
    kv_cache_dtype: str
    attention_backend: str
    linear_backend: str
    mesh_shape: dict[str, int]  # mesh axis -> size ({} without a mesh)
    devices: str
    compiled_programs: int = 0  # set once warmup is done ("ready")
    cached_programs: int = 0  # of those, read from the persistent compilation cache
    compilation_cache: str = ""  # its directory ("": off)
    loaded_programs: int = 0  # of the cached ones, loaded as executables (nothing traced)

    def to_wire(self) -> list:
        return [*self[:1], list(dataclasses.astuple(self.limits)), *self[2:]]

    @classmethod
    def from_wire(cls, w: Sequence) -> EngineInfo:
        return cls(EngineCapacity(*w[0]), EngineLimits(*w[1]), *w[2:])


class AddRequests(NamedTuple):
    tag: str = "add"
    requests: Sequence[Any] = ()  # CoreRequest, or its `request_to_wire` list


class Abort(NamedTuple):
    tag: str = "abort"
    request_ids: Sequence[str] = ()  # child ids


class Finish(NamedTuple):
    tag: str = "finish"
    stops: Sequence[tuple[str, str]] = ()  # (child id, the stop string that matched)


class Shutdown(NamedTuple):
    tag: str = "shutdown"


class RemoveLoRA(NamedTuple):
    """An adapter was unloaded (`/v1/unload_lora_adapter`; vLLM's `remove_lora`): the core frees
    its slot now, or once the requests running under it end (`LoRASlots.forget`)."""

    tag: str = "remove_lora"
    lora_int_id: int = 0


class StartProfile(NamedTuple):
    """Start a profiler trace into the core's trace dir (vLLM's `/start_profile`)."""

    tag: str = "start_profile"


class StopProfile(NamedTuple):
    """Stop it; the core writes it off its engine thread and logs the path."""

    tag: str = "stop_profile"


class Loaded(NamedTuple):
    """The model is on its devices."""

    tag: str = "loaded"
    info: EngineInfo | None = None


class Ready(NamedTuple):
    """Every program is compiled (`info.compiled_programs`): requests may come."""

    tag: str = "ready"
    info: EngineInfo | None = None


class Broken(NamedTuple):
    """The core cannot serve (`why`); `exited`: its process is gone (the front end exits)."""

    tag: str = "broken"
    why: str = ""
    exited: bool = False


class StepResult(NamedTuple):
    """One engine step's results: new tokens, the requests it lost (failed or rejected: the
    front end fails them with `error`), and the load after it. `bad_argument`: the lost
    requests were refused for what the client sent (`error` starts with the field at fault:
    a grammar that does not compile or is too expensive, a prompt `check_prompt` refuses): the
    front end fails them as invalid arguments (400 / INVALID_ARGUMENT), not as server errors."""

    tag: str = "step"
    outputs: Sequence[Any] = ()  # TokenOutput, or its `to_wire` form
    lost: Sequence[str] = ()
    error: str | None = None
    stats: EngineStats = EngineStats()
    bad_argument: bool = False


Message = (
    AddRequests
    | Abort
    | Finish
    | Shutdown
    | RemoveLoRA
    | StartProfile
    | StopProfile
    | Loaded
    | Ready
    | Broken
    | StepResult
)

_MESSAGES: dict[str, Any] = {
    m._field_defaults["tag"]: m
    for m in (
        AddRequests,
        Abort,
        Finish,
        Shutdown,
        RemoveLoRA,
        StartProfile,
        StopProfile,
        Loaded,
        Ready,
        Broken,
        StepResult,
    )
}


def encode(msg: Message) -> Sequence:
    """`msg` as msgpack packs it (a list of its fields: nested records as lists too)."""
    if isinstance(msg, (Loaded, Ready)) and msg.info is not None:
        return (msg.tag, msg.info.to_wire())
    if isinstance(msg, StepResult):
        outputs = [to_wire(o) for o in msg.outputs]
        return (msg.tag, outputs, msg.lost, msg.error, msg.stats, msg.bad_argument)
    if isinstance(msg, AddRequests):
        return (msg.tag, [request_to_wire(r) for r in msg.requests])
    return msg


def decode_message(w: Sequence) -> Message:
    """The typed message of a received list (a typed message stays as it is)."""
    if isinstance(w, tuple) and type(w) is not tuple:
        return w  # type: ignore[return-value]
    cls = _MESSAGES.get(w[0])
    if cls is None:
        raise ValueError(f"unknown engine message {w[0]!r}")
    if cls is StepResult:
        return StepResult(w[0], w[1], w[2], w[3], EngineStats._make(w[4]), bool(w[5]))
    if cls is Loaded or cls is Ready:
        return cls(w[0], None if w[1] is None else EngineInfo.from_wire(w[1]))
    return cls._make(w)


def wire_outputs(msg: Sequence) -> list[TokenOutput]:
    """The `TokenOutput`s of a `StepResult` (decoded from their wire form where they are lists)."""
    return [from_wire(w) if isinstance(w, list) else w for w in msg[1]]


def request_of(w: CoreRequest | list) -> CoreRequest:
    """An `AddRequests` entry as a `CoreRequest`."""
    return request_from_wire(w) if isinstance(w, list) else w
