"""README features through the real served process, asserting their effect.

One `scripts/serve.py` (engine core in its own process, both protocols) serves the successor
model (`served_utils.successor_model_dir`: real safetensors weights and SmolLM2's tokenizer,
greedy next token = last token + 1, a 3-cycle 3000 -> 3001 -> 3002 with a runner-up exactly one
logit below 3001), so every answer is known in plain Python:
1. greedy tokens equal `successors(...)` on gRPC and HTTP (single device, async scheduling, the
   cpu attention kernel, f32, the HF-dir `--model`);
2. request fields change the tokens the way they promise: stop ids stop, EOS stops, `ignore_eos`
   runs past it, `min_tokens` holds it back, penalties swap the repeated token for the runner-up,
   `top_k` / `top_p` / `min_p` keep only the leader under sampling, logprobs equal the model's
   (-log(1 + e^-1) for a one-logit gap), cached prompt tokens are counted;
3. the server's flags show: `--served-model-name`, `--http-host`, `--max-model-len`,
   `--num-pages`, `--max-num-batched-tokens` (prefill steps counted on /metrics),
   `--token-buckets` (compiled programs counted on /metrics), `--log-interval`,
   `--metrics-port`, health and reflection;
4. the Python API and scripts over the same checkpoint: `LLM.chat`, `scripts/generate.py --chat`
   and `scripts/client.py --chat` against this server.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from datetime import datetime

import grpc
import pytest
from grpc_health.v1 import health_pb2
from served_utils import (
    CYCLE,
    ROOT,
    RUNNER_UP,
    TINY_BUCKETS,
    ServedProcess,
    successor_model_dir,
    successors,
)

from serving.client import GenerateClient, build_request
from serving.protos.jaxinfer.v1 import generate_pb2 as pb

pytestmark = pytest.mark.slow  # a server subprocess

openai = pytest.importorskip("openai")

V = 49152  # SmolLM2's vocabulary
EOS = 2  # <|im_end|> (0, <|endoftext|>, is the other EOS id)
NAME = "succ"
HTTP_HOST = "127.0.0.2"  # --http-host apart from --host (127.0.0.1)
ARGS = [
    *TINY_BUCKETS,
    "--no-warmup",
    "--max-model-len",
    "256",
    "--max-num-seqs",
    "4",
    "--max-num-batched-tokens",
    "64",
    "--num-pages",
    "64",
    "--served-model-name",
    NAME,
    "--http-host",
    HTTP_HOST,
    "--log-interval",
    "0.2",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return successor_model_dir(tmp_path_factory.mktemp("succ") / "succ")


@pytest.fixture(scope="module")
def served(model_dir):
    srv = ServedProcess(["--model", str(model_dir), *ARGS])
    yield srv
    assert srv.stop() == 0, "".join(srv.log[-30:])


@pytest.fixture(scope="module")
def grpc_client(served):
    c = GenerateClient(served.grpc_address)
    yield c
    c.close()


@pytest.fixture(scope="module")
def http(served):
    return openai.OpenAI(base_url=served.http_url, api_key="unused", max_retries=0, timeout=300)


def grpc_tokens(c: GenerateClient, prompt, **kw) -> tuple[list[int], int, list]:
    """(token ids, finish reason, responses) of one gRPC stream."""
    msgs = list(c.generate(prompt, timeout=300, **kw))
    return [t for m in msgs for t in m.token_ids], msgs[-1].finish_reason, msgs


def http_text(http, prompt, **extra) -> tuple[str, str]:
    """(text, finish reason) of one HTTP completion."""
    r = http.completions.create(model=NAME, prompt=prompt, **extra)
    return r.choices[0].text, r.choices[0].finish_reason


def text(ids: list[int]) -> str:
    from engine_utils import load_vocab

    return load_vocab().decode(ids)


def test_greedy_tokens_are_the_models_on_both_protocols(served, grpc_client, http):
    prompt = [1000, 1001, 5000]
    ids, finish, _ = grpc_tokens(grpc_client, prompt, max_tokens=8, temperature=0)
    assert ids == successors(5000, 8, V) and finish == 2  # LENGTH
    r = http.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason == "length"
    from engine_utils import load_vocab

    assert r.choices[0].text == load_vocab().decode(successors(5000, 8, V))
    info = grpc_client.model_info()
    assert info.dtype == "float32" and info.attention_backend == "cpu"
    assert info.linear_backend in ("cpu", "xla")  # cpu needs AVX2 + FMA or AVX-512
    log = "".join(served.log)
    assert "scheduling async; prefix caching on" in log, log[-2000:]


def test_stop_token_ids_stop_on_both_protocols(grpc_client, http):
    want = successors(5000, 8, V)
    ids, finish, _ = grpc_tokens(
        grpc_client, [5000], max_tokens=8, temperature=0, stop_token_ids=[want[2]]
    )
    assert ids == want[:3] and finish == 1  # STOP, the stop id included in the ids
    got, finish = http_text(
        http, [5000], max_tokens=8, temperature=0, extra_body={"stop_token_ids": [want[2]]}
    )
    assert got == text(want[:2]) and finish == "stop"  # but not in the text (as vLLM)
    got, _ = http_text(
        http,
        [5000],
        max_tokens=8,
        temperature=0,
        extra_body={"stop_token_ids": [want[2]], "include_stop_str_in_output": True},
    )
    assert got == text(want[:3])


def test_eos_stops_and_ignore_eos_runs_past_it(grpc_client, http):
    ids, finish, _ = grpc_tokens(grpc_client, [500, 0], max_tokens=6, temperature=0)
    assert ids == [1, EOS] and finish == 1
    ids, finish, _ = grpc_tokens(
        grpc_client, [500, 0], max_tokens=6, temperature=0, ignore_eos=True
    )
    assert ids == [1, 2, 3, 4, 5, 6] and finish == 2
    got, finish = http_text(
        http, [500, 0], max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert finish == "length" and got == text([1, 2, 3, 4, 5, 6])


def test_min_tokens_holds_eos_back(grpc_client, http):
    ids, finish, _ = grpc_tokens(grpc_client, [500, 1], max_tokens=6, temperature=0)
    assert ids == [EOS] and finish == 1
    ids, _, _ = grpc_tokens(grpc_client, [500, 1], max_tokens=6, temperature=0, min_tokens=3)
    assert len(ids) >= 3 and EOS not in ids[:3] and 0 not in ids[:3], ids
    r = http.completions.create(
        model=NAME, prompt=[500, 1], max_tokens=6, temperature=0, extra_body={"min_tokens": 3}
    )
    assert r.usage.completion_tokens >= 3 and r.choices[0].text, r


PLAIN_CYCLE = [CYCLE[1], CYCLE[2], CYCLE[0], CYCLE[1], CYCLE[2]]
# The 4th token repeats 3001 (an output token): a penalty of more than one logit hands it to the
# runner-up, which then counts on (3004, ...).
PENALIZED = [CYCLE[1], CYCLE[2], CYCLE[0], RUNNER_UP, RUNNER_UP + 1]


@pytest.mark.parametrize(
    "field,value",
    [("frequency_penalty", 1.5), ("presence_penalty", 1.5), ("repetition_penalty", 1.1)],
)
def test_a_penalty_hands_the_repeated_token_to_the_runner_up(grpc_client, http, field, value):
    ids, _, msgs = grpc_tokens(grpc_client, [CYCLE[0]], max_tokens=5, temperature=0, logprobs=1)
    assert ids == PLAIN_CYCLE
    plain_lp = [lp.logprob for m in msgs for lp in m.logprobs]
    ids, _, msgs = grpc_tokens(
        grpc_client, [CYCLE[0]], max_tokens=5, temperature=0, logprobs=1, **{field: value}
    )
    assert ids == PENALIZED, field
    lp = [lp.logprob for m in msgs for lp in m.logprobs]
    assert lp[3] < plain_lp[3] - 0.9  # the runner-up's raw logprob: one logit lower
    extra = {"repetition_penalty": value} if field == "repetition_penalty" else {}
    plain = {} if extra else {field: value}
    got, _ = http_text(
        http, [CYCLE[0]], max_tokens=5, temperature=0, extra_body=extra or None, **plain
    )
    assert got == text(PENALIZED), field


def test_logprobs_are_the_models(grpc_client, http):
    """After 3000 the leader is one logit above the runner-up and ~13 above the rest."""
    lead = -math.log1p(math.exp(-1.0))
    _, _, msgs = grpc_tokens(
        grpc_client, list(CYCLE), max_tokens=1, temperature=0, logprobs=2, prompt_logprobs=1
    )
    first = msgs[0]
    assert [p.token_id for p in first.prompt_logprobs] == [CYCLE[1], CYCLE[2]]
    assert first.prompt_logprobs[0].logprob == pytest.approx(lead, abs=0.02)
    assert first.prompt_logprobs[0].top[0].token_id == CYCLE[1]
    got = first.logprobs[0]  # after 3002 comes 3000, no close runner-up
    assert got.token_id == CYCLE[0] and got.logprob == pytest.approx(0.0, abs=1e-3)
    r = http.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=1,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    assert r.choices[0].logprobs.content[0].logprob == pytest.approx(0.0, abs=1e-3)
    r = http.completions.create(
        model=NAME, prompt=[CYCLE[0]], max_tokens=1, temperature=0, logprobs=2
    )
    assert r.choices[0].logprobs.token_logprobs[0] == pytest.approx(lead, abs=0.02)


@pytest.mark.parametrize("field,value", [("top_k", 1), ("top_p", 0.5), ("min_p", 0.5)])
def test_sampling_filters_keep_only_the_leader(grpc_client, http, field, value):
    """At temperature 1 the runner-up after 3000 has p = 0.27: one of 16 samples takes it
    (0.73^16 = 0.6% that none does; the seed makes it fixed); a filter leaves only the leader."""
    kw = dict(max_tokens=1, temperature=1.0, seed=7, n=16)
    _, _, msgs = grpc_tokens(grpc_client, [CYCLE[0]], **kw)
    assert RUNNER_UP in {t for m in msgs for t in m.token_ids}
    _, _, msgs = grpc_tokens(grpc_client, [CYCLE[0]], **kw, **{field: value})
    assert {t for m in msgs for t in m.token_ids} == {CYCLE[1]}
    fields = {"top_p": value} if field == "top_p" else {"extra_body": {field: value}}
    r = http.completions.create(
        model=NAME, prompt=[CYCLE[0]], max_tokens=1, temperature=1.0, seed=7, n=16, **fields
    )
    assert {c.text for c in r.choices} == {text([CYCLE[1]])}


def test_seed_repeats_a_sample(grpc_client):
    kw = dict(max_tokens=4, temperature=1.0, seed=11, n=4)
    a = [m.token_ids for m in grpc_tokens(grpc_client, [CYCLE[0]], **kw)[2]]
    b = [m.token_ids for m in grpc_tokens(grpc_client, [CYCLE[0]], **kw)[2]]
    assert a == b


def test_stop_strings_cut_the_text(http):
    from engine_utils import load_vocab

    tok = load_vocab()
    text = tok.decode(successors(5000, 8, V))
    stop = tok.decode(successors(5000, 8, V)[3:4]).strip()
    r = http.completions.create(model=NAME, prompt=[5000], max_tokens=8, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stop)]


def test_cached_prompt_tokens_are_counted_on_both_protocols(grpc_client, http):
    prompt = list(range(7000, 7040))  # 40 tokens: two whole 16-token pages
    _, _, msgs = grpc_tokens(grpc_client, prompt, max_tokens=1, temperature=0)
    _, _, msgs = grpc_tokens(grpc_client, prompt, max_tokens=1, temperature=0)
    assert msgs[-1].usage.cached_prompt_tokens == 32
    r = http.completions.create(model=NAME, prompt=prompt, max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens == 32


def test_request_id_echoed_and_model_name_served(served, http):
    raw = http.completions.with_raw_response.create(model=NAME, prompt=[5000], max_tokens=2)
    body = raw.parse()
    assert body.id.startswith("cmpl-") and raw.headers["x-request-id"] == body.id
    assert [m.id for m in http.models.list().data] == [NAME]
    with pytest.raises(openai.NotFoundError):
        http.completions.create(model="other", prompt=[5000], max_tokens=2)
    assert served.http_url.startswith(f"http://{HTTP_HOST}:")


def test_n_streams_and_usage(http):
    stream = http.completions.create(
        model=NAME,
        prompt=[5000],
        max_tokens=4,
        temperature=0,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, usage = {0: "", 1: ""}, None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
        usage = chunk.usage or usage
    from engine_utils import load_vocab

    want = load_vocab().decode(successors(5000, 4, V))
    assert texts == {0: want, 1: want} and usage.completion_tokens == 8


def test_chat_on_both_protocols_and_its_template_kwargs(grpc_client, http):
    messages = [{"role": "user", "content": "Hi"}]
    req = pb.TokenizeRequest(messages=build_request(messages).messages)
    prompt = grpc_client.stub.Tokenize(req).token_ids
    ids, _, _ = grpc_tokens(grpc_client, messages, max_tokens=3, temperature=0)
    assert ids == successors(prompt[-1], 3, V)
    r = http.chat.completions.create(model=NAME, messages=messages, max_tokens=3, temperature=0)
    from engine_utils import load_vocab

    assert r.choices[0].message.content == load_vocab().decode(successors(prompt[-1], 3, V))
    r2 = http.chat.completions.create(
        model=NAME,
        messages=messages,
        max_tokens=3,
        temperature=0,
        extra_body={"chat_template_kwargs": {"add_generation_prompt": False}},
    )
    assert r2.usage.prompt_tokens < r.usage.prompt_tokens


def test_response_format_text_leaves_the_output_alone(http):
    r = http.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        response_format={"type": "text"},
    )
    plain = http.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0
    )
    assert r.choices[0].message.content == plain.choices[0].message.content


def test_budgets_and_limits_reach_the_engine(served, grpc_client):
    """--max-num-batched-tokens 64: a 130-token prompt takes 3 prefill steps (/metrics counts
    them); --num-pages 64 (63 usable), --max-model-len 256, --max-num-seqs 4 are reported and a
    prompt + max_tokens past 256 is refused naming max_tokens."""
    info = grpc_client.model_info()
    assert info.max_model_len == 256 and info.page_size == 16
    assert info.capacity.num_pages == 63 and info.capacity.max_num_batched_tokens == 64
    assert info.capacity.max_num_seqs == 4
    before = served.metric("jaxinfer_engine_steps_total")
    grpc_tokens(grpc_client, list(range(8000, 8130)), max_tokens=1, temperature=0)
    assert served.metric("jaxinfer_engine_steps_total") - before >= 3
    with pytest.raises(grpc.RpcError) as e:
        grpc_tokens(grpc_client, [5000] * 10, max_tokens=250)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens" in e.value.details()


def test_token_buckets_bound_the_compiled_programs(served, grpc_client):
    """--token-buckets 4,64: prompts of 3 to 50 tokens, one at a time, and their decodes run in
    the 4- and 64-token programs. The default buckets would compile six for these steps alone
    (1, 4, 8, 16, 32, 64); with two, the module's whole workload needs at most 2 x 2 step
    programs (with and without prompt logits) and one structured-output sampler."""
    for start, n in zip(range(8200, 8700, 100), (3, 6, 12, 30, 50), strict=True):
        grpc_tokens(grpc_client, list(range(start, start + n)), max_tokens=2, temperature=0)
    assert 2 <= served.metric("jaxinfer_compiled_programs") <= 5


def test_service_health_reflection_and_metrics(served, grpc_client):
    assert grpc_client.health_status() == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(grpc_client.channel)
    req = reflection_pb2.ServerReflectionRequest(list_services="")
    names = [
        s.name
        for r in stub.ServerReflectionInfo(iter([req]))
        for s in r.list_services_response.service
    ]
    assert "jaxinfer.v1.GenerateService" in names
    before = served.metric("jaxinfer_generation_tokens_total")
    grpc_tokens(grpc_client, [5000], max_tokens=5, temperature=0)
    assert served.metric("jaxinfer_generation_tokens_total") - before == 5
    deadline = time.monotonic() + 30  # the gauge follows the load line (every 0.2 s here)
    while served.metric("jaxinfer_generation_tokens_per_second") <= 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_log_interval_spaces_the_load_lines(served, grpc_client):
    """--log-interval 0.2: consecutive load lines while busy are well under the default 1 s."""
    start = len(served.log)
    grpc_tokens(grpc_client, [10, 500], max_tokens=200, temperature=0, ignore_eos=True)
    stamps = [
        datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
        for line in served.log[start:]
        if "serving.frontend: running" in line
    ]
    gaps = [(b - a).total_seconds() for a, b in zip(stamps, stamps[1:], strict=False)]
    assert gaps and min(gaps) < 0.6, gaps


def test_llm_chat_through_the_generate_script(model_dir):
    """`scripts/generate.py --chat` (what `make generate` runs) is `LLM.chat` on the checkpoint."""
    from engine_utils import load_vocab

    tok = load_vocab()
    last = tok.encode_chat([{"role": "user", "content": "Hi"}])[-1]
    script = [sys.executable, str(ROOT / "scripts" / "generate.py"), "--model", str(model_dir)]
    cmd = [*script, "--chat", "--prompt", "Hi", "--max-tokens", "3", "--max-model-len", "128"]
    res = subprocess.run(cmd, capture_output=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.decode() == tok.decode(successors(last, 3, V)) + "\n"
    assert "3 generated, finish: length" in res.stderr.decode()


def test_client_script_chat(served, grpc_client):
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "client.py"),
        "--host",
        "127.0.0.1",
        "--port",
        served.grpc_address.rsplit(":", 1)[1],
        "--chat",
        "Hi",
        "--max-tokens",
        "3",
        "--temperature",
        "0",
    ]
    res = subprocess.run(cmd, capture_output=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    ids, _, _ = grpc_tokens(
        grpc_client, [{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0
    )
    from engine_utils import load_vocab

    assert load_vocab().decode(ids) in res.stdout.decode()
