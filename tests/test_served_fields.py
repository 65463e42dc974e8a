"""vLLM's request fields, cache salts, priority scheduling, the utility endpoints and the API key,
through the real served process (`scripts/serve.py --scheduling-policy priority --api-key KEY`,
tiny model with random weights), driven by the `openai` client, plain HTTP and the gRPC stub.

1. Completions `echo` with `logprobs` and `max_tokens=0` (lm-evaluation-harness's loglikelihood):
   the prompt comes back with its logprobs (None first), equal to the logprobs the same tokens
   had when they were generated; nothing generated is returned or counted; streamed alike.
2. `logit_bias` (+100 on one id: greedy emits only it), `allowed_token_ids` (every sampled id is
   one of them), `bad_words` (the greedy first word never comes), `include_stop_str_in_output`,
   the legacy `guided_choice`, `return_tokens_as_token_ids`, and the same token controls on gRPC.
3. `cache_salt`: one prompt twice under salt "a" hits the prefix cache (`cached_tokens` > 0,
   and the same count on `vllm:prefix_cache_hits`); under salt "b", or no salt, it does not;
   on gRPC too.
4. Priority: four long requests fill every row, four low-priority requests queue, then one
   high-priority request: it finishes before the last low one (first come first served would
   run it last).
5. `--api-key`: HTTP without the Bearer key is a 401 OpenAI error (`/health`, `/ping`,
   `/metrics` stay open); gRPC without `authorization` metadata is UNAUTHENTICATED.
6. An unknown field is a 400 naming it; `/tokenize`, `/detokenize`, `/version`, `/ping`; 404 and
   405 are OpenAI error objects.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from served_utils import serve_tiny

from serving.client import build_request
from serving.protos.jaxinfer.v1 import generate_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow  # a server subprocess: imports JAX, compiles on first use

openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")

KEY = "test-key-123"
AUTH = (("authorization", f"Bearer {KEY}"),)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    srv = serve_tiny(
        tmp_path_factory.mktemp("served") / "tiny",
        "--scheduling-policy",
        "priority",
        "--api-key",
        KEY,
    )
    yield srv
    assert srv.stop() == 0, "".join(srv.log[-30:])


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.http_url, api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def root(served):
    return served.http_url.removesuffix("/v1")


@pytest.fixture(scope="module")
def stub(served):
    channel = grpc.insecure_channel(served.grpc_address)
    yield pb_grpc.GenerateServiceStub(channel)
    channel.close()


def ids_of(choice) -> list[int]:
    """Token ids of a completion choice asked with logprobs + return_tokens_as_token_ids."""
    return [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]


def complete(client, model, prompt, **kw):
    extra = kw.pop("extra_body", {})
    return client.completions.create(
        model=model, prompt=prompt, temperature=0, extra_body=extra, **kw
    )


def tokenize(root, text: str) -> list[int]:
    r = requests.post(
        f"{root}/tokenize", json={"prompt": text}, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_echo_logprobs_max_tokens_0_scores_the_prompt(client, model, root):
    gen = complete(
        client,
        model,
        "The quick brown fox",
        max_tokens=3,
        logprobs=1,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
    ).choices[0]
    prompt_ids = tokenize(root, "The quick brown fox")
    full = prompt_ids + ids_of(gen)
    r = complete(client, model, full, max_tokens=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(full) and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and all(t for t in lp.top_logprobs[1:])
    scored = lp.token_logprobs[len(prompt_ids) :]
    assert scored == pytest.approx(gen.logprobs.token_logprobs, abs=2e-3)
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(full)
    assert r.choices[0].text == "".join(lp.tokens)
    chunks = client.completions.create(
        model=model, prompt=full, max_tokens=0, echo=True, logprobs=1, temperature=0, stream=True
    )
    streamed = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in streamed) == r.choices[0].text
    assert streamed[0].logprobs.token_logprobs == lp.token_logprobs
    more = complete(client, model, "The quick brown fox", max_tokens=2, echo=True)
    assert more.choices[0].text.startswith("The quick brown fox")
    assert len(more.choices[0].text) > len("The quick brown fox")


def test_logit_bias_allowed_token_ids_and_bad_words(client, model):
    tids = {"return_tokens_as_token_ids": True, "ignore_eos": True}
    r = complete(client, model, "hi", max_tokens=4, logprobs=0, logit_bias={"1234": 100},
                 extra_body=tids)  # fmt: skip
    assert ids_of(r.choices[0]) == [1234] * 4
    allowed = [1234, 2345, 3456]
    r = client.completions.create(
        model=model,
        prompt="hi",
        max_tokens=8,
        temperature=1.0,
        seed=5,
        logprobs=0,
        extra_body={**tids, "allowed_token_ids": allowed},
    )
    assert set(ids_of(r.choices[0])) <= set(allowed)
    first = complete(client, model, "hello there", max_tokens=1, logprobs=0, extra_body=tids)
    (t0,) = ids_of(first.choices[0])
    word = complete(client, model, "hello there", max_tokens=1).choices[0].text.strip()
    assert word, "the greedy first token has no word to ban"
    banned = complete(
        client, model, "hello there", max_tokens=3, logprobs=0,
        extra_body={**tids, "bad_words": [word]},
    )  # fmt: skip
    assert ids_of(banned.choices[0])[0] != t0
    assert word not in banned.choices[0].text


def test_include_stop_str_and_guided_choice(client, model):
    base = complete(client, model, "hello", max_tokens=6, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    cut = text[: text.find(stop)]
    kw = {"max_tokens": 6, "stop": [stop]}
    without = complete(client, model, "hello", extra_body={"ignore_eos": True}, **kw)
    with_ = complete(
        client,
        model,
        "hello",
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
        **kw,
    )
    assert without.choices[0].text == cut
    assert with_.choices[0].text == cut + stop
    r = complete(client, model, "pick", max_tokens=8, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no")


def test_cache_salt_isolates_prefix_cache(client, model, served):
    prompt = "salted " * 40  # several full KV pages

    def cached(salt=None, **kw):
        """(cached tokens in the usage, the hits the engine counted) of one request."""
        extra = {} if salt is None else {"cache_salt": salt}
        before = served.metric("vllm:prefix_cache_hits_total")  # cached prompt tokens
        r = complete(client, model, prompt, max_tokens=1, extra_body=extra, **kw)
        hits = served.metric("vllm:prefix_cache_hits_total") - before
        assert hits == r.usage.prompt_tokens_details.cached_tokens
        return hits

    assert cached("a") == 0
    assert cached("a") > 0  # same salt: hit
    assert cached("b") == 0  # another tenant: no hit on "a"'s pages
    assert cached() == 0  # no salt: no hit either
    assert cached("b") > 0


def test_grpc_fields_and_cache_salt(stub):
    def run(**kw):
        salt = kw.pop("cache_salt", None)
        kw = {"max_tokens": 3, "temperature": 0, "ignore_eos": True, **kw}
        req = build_request("grpc salted prompt " * 12, **kw)
        if salt is not None:
            req.cache_salt = salt
        return stub.GenerateOnce(req, metadata=AUTH, timeout=300)

    assert list(run(logit_bias={77: 100.0}).token_ids) == [77] * 3
    assert set(run(allowed_token_ids=[5000, 6000], temperature=1.0, seed=1).token_ids) <= {
        5000,
        6000,
    }
    assert run(cache_salt="x").usage.cached_prompt_tokens == 0
    assert run(cache_salt="x").usage.cached_prompt_tokens > 0
    assert run(cache_salt="y").usage.cached_prompt_tokens == 0
    with pytest.raises(grpc.RpcError) as info:
        run(logit_bias={77: 1000.0})
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.logit_bias.77" in info.value.details()


def test_priority_runs_the_urgent_request_first(client, model, root):
    started = [threading.Event() for _ in range(4)]
    done: dict[str, float] = {}
    errors: list[BaseException] = []

    def blocker(i: int) -> None:
        try:
            stream = client.completions.create(
                model=model, prompt=f"block {i}", max_tokens=200, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            for _ in stream:
                started[i].set()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
            started[i].set()

    def queued(name: str, priority: int) -> None:
        try:
            complete(client, model, f"q {name}", max_tokens=8,
                     extra_body={"ignore_eos": True, "priority": priority})  # fmt: skip
            done[name] = time.monotonic()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=blocker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(120), "a blocker never started"
    lows = [threading.Thread(target=queued, args=(f"low{i}", 5)) for i in range(4)]
    for t in lows:
        t.start()
    deadline = time.monotonic() + 60
    while waiting(root) < 4:  # every low-priority request has arrived before the urgent one
        assert time.monotonic() < deadline, "the low-priority requests never queued"
        time.sleep(0.02)
    high = threading.Thread(target=queued, args=("high", -5))
    high.start()
    for t in [*threads, *lows, high]:
        t.join(180)
    assert not errors, errors
    assert done["high"] < max(done[f"low{i}"] for i in range(4)), done


def waiting(root) -> float:
    text = requests.get(f"{root}/metrics").text
    for line in text.splitlines():
        if line.startswith("jaxinfer_num_requests_waiting "):
            return float(line.split()[1])
    raise AssertionError("no jaxinfer_num_requests_waiting gauge")


def test_api_key_on_both_protocols(served, model, root, stub):
    anonymous = openai.OpenAI(base_url=served.http_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        anonymous.completions.create(model=model, prompt="hi", max_tokens=1)
    assert info.value.body["param"] == "authorization"
    assert requests.post(f"{root}/tokenize", json={"prompt": "x"}).status_code == 401
    for path in ("/health", "/ping", "/metrics"):
        assert requests.get(root + path).status_code == 200, path
    req = build_request("hi", max_tokens=1)
    with pytest.raises(grpc.RpcError) as info:
        stub.GenerateOnce(req, timeout=60)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as info:
        stub.GenerateOnce(req, metadata=(("authorization", "Bearer nope"),), timeout=60)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert stub.GenerateOnce(req, metadata=AUTH, timeout=60).usage.completion_tokens == 1


def test_unknown_field_and_endpoints(client, model, root):
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, model, "hi", max_tokens=1, extra_body={"max_token": 3})
    assert info.value.body["param"] == "max_token"
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, model, "hi", max_tokens=1, extra_body={"use_beam_search": True})
    assert info.value.body["param"] == "use_beam_search"
    auth = {"Authorization": f"Bearer {KEY}"}
    tok = requests.post(
        f"{root}/tokenize", json={"prompt": "hello there", "return_token_strs": True}, headers=auth
    ).json()
    assert tok["count"] == len(tok["tokens"]) and "".join(tok["token_strs"]) == "hello there"
    text = requests.post(f"{root}/detokenize", json={"tokens": tok["tokens"]}, headers=auth)
    assert text.json() == {"prompt": "hello there"}
    assert requests.get(f"{root}/version", headers=auth).json()["version"]
    assert requests.post(f"{root}/ping").status_code == 200
    missing = requests.get(f"{root}/v1/nope", headers=auth)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
    wrong = requests.get(f"{root}/v1/completions", headers=auth)
    assert wrong.status_code == 405 and wrong.json()["error"]["type"] == "invalid_request_error"
