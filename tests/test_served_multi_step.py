"""`--num-scheduler-steps` through the real served process, asserting its effect.

One `scripts/serve.py --num-scheduler-steps 4` (engine core in its own process, warmup on, async
scheduling) serves the successor model (`served_utils.successor_model_dir`: greedy next token =
last token + 1), so every answer is known in plain Python:
1. the flag reaches the engine core (its start-up line) and warmup builds the multi-step
   programs: no request compiles another;
2. greedy streams on gRPC and HTTP decode the model's tokens in a quarter of the steps;
3. stop ids, EOS, `ignore_eos`, `min_tokens`, stop strings and `max_tokens` end a stream on the
   same token as a plain step would, also in the middle of a program's steps;
4. concurrent streams of different lengths are all exact, and one asking for logprobs gets one
   for every token.
"""

from __future__ import annotations

import threading

import pytest
from served_utils import TINY_BUCKETS, ServedProcess, successor_model_dir, successors

from serving.client import GenerateClient

pytestmark = pytest.mark.slow  # a server subprocess

openai = pytest.importorskip("openai")

V = 49152  # SmolLM2's vocabulary
EOS = 2


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = successor_model_dir(tmp_path_factory.mktemp("succ") / "succ")
    args = [
        *("--model", str(model), *TINY_BUCKETS, "--max-model-len", "128"),
        *("--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--num-pages", "64"),
        *("--num-scheduler-steps", "4", "--served-model-name", "succ"),
    ]
    srv = ServedProcess(args)
    yield srv
    assert srv.stop() == 0, "".join(srv.log[-30:])


@pytest.fixture(scope="module")
def client(served):
    c = GenerateClient(served.grpc_address)
    yield c
    c.close()


@pytest.fixture(scope="module")
def http(served):
    return openai.OpenAI(base_url=served.http_url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def warm_programs(served, client):
    """Programs warmup built (read before any request)."""
    return served.metric("jaxinfer_compiled_programs")


def tokens(c: GenerateClient, prompt, **kw) -> tuple[list[int], int]:
    return stream(c, prompt, **kw)[:2]


def stream(c: GenerateClient, prompt, **kw) -> tuple[list[int], int, list]:
    """(token ids, finish reason, logprobs) of one greedy gRPC stream."""
    msgs = list(c.generate(prompt, timeout=300, temperature=0, **kw))
    lps = [lp for m in msgs for lp in m.logprobs]
    return [t for m in msgs for t in m.token_ids], msgs[-1].finish_reason, lps


def text(ids: list[int]) -> str:
    from engine_utils import load_vocab

    return load_vocab().decode(ids)


def test_the_flag_reaches_the_core_and_warmup_builds_the_programs(served, warm_programs):
    log = "".join(served.log)
    assert "num_scheduler_steps 4" in log, log[-2000:]
    assert warm_programs > 0


def test_greedy_streams_take_a_quarter_of_the_steps(served, client, http):
    before = served.metric("jaxinfer_engine_steps_total")
    ids, finish = tokens(client, [1000, 5000], max_tokens=21)
    assert ids == successors(5000, 21, V) and finish == 2  # LENGTH
    # the prefill's step, then 20 tokens in programs of 4 steps (5), +1 for async's last step
    assert served.metric("jaxinfer_engine_steps_total") - before <= 7
    r = http.completions.create(model="succ", prompt=[7000], max_tokens=13, temperature=0)
    assert r.choices[0].text == text(successors(7000, 13, V))
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 13


def test_stops_end_the_stream_on_the_same_token(client, http):
    want = successors(5000, 12, V)
    for at in (1, 2, 5, 6):  # inside the first program's steps and inside the second's
        ids, finish = tokens(client, [5000], max_tokens=12, stop_token_ids=[want[at]])
        assert ids == want[: at + 1] and finish == 1, at  # STOP
    ids, finish = tokens(client, [500, 0], max_tokens=6)
    assert ids == [1, EOS] and finish == 1
    ids, finish = tokens(client, [500, 0], max_tokens=6, ignore_eos=True)
    assert ids == [1, 2, 3, 4, 5, 6] and finish == 2
    ids, _ = tokens(client, [500, 1], max_tokens=6, min_tokens=3)
    assert len(ids) >= 3 and EOS not in ids[:3] and 0 not in ids[:3], ids
    stop = text(want[7:8]).strip()
    r = http.completions.create(
        model="succ", prompt=[5000], max_tokens=12, temperature=0, stop=[stop]
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text(want)[: text(want).index(stop)]


def test_concurrent_streams_and_a_logprobs_one_are_exact(served, client, warm_programs):
    jobs = [(8000, 7, {}), (9000, 16, {}), (10000, 11, {"logprobs": 1}), (11000, 30, {})]
    got: dict[int, tuple[list[int], int, list]] = {}

    def one(first: int, n: int, kw: dict) -> None:
        got[first] = stream(client, [first], max_tokens=n, **kw)

    threads = [threading.Thread(target=one, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for first, n, _ in jobs:
        assert got[first][:2] == (successors(first, n, V), 2), first
    lps = got[10000][2]
    assert [lp.token_id for lp in lps] == successors(10000, 11, V)
    assert all(lp.logprob > -0.01 for lp in lps)  # the successor leads by ~15 logits
    assert served.metric("jaxinfer_compiled_programs") == warm_programs  # nothing compiled
