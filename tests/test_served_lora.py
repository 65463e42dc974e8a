"""Multi-LoRA through the real `scripts/serve.py` (one server): `--enable-lora --lora-modules`,
the OpenAI `model` field naming an adapter, `/v1/models` listing adapters with their `parent`,
and vLLM's runtime `/v1/load_lora_adapter` / `/v1/unload_lora_adapter` (with
`VLLM_ALLOW_RUNTIME_LORA_UPDATING`; an unload frees the core's slot once the requests running
under the adapter end), refusals naming the field; `vllm:lora_requests_info` and the per-adapter
request counter on /metrics; a second server on a `tensor=2` mesh serves the adapter's greedy
output of the one-device server."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from engine_utils import TINY_LLAMA
from served_utils import serve_tiny

pytestmark = pytest.mark.slow  # a server subprocess: imports JAX, compiles on first use


def write_adapter(path, rank: int, seed: int, modules=("q_proj", "v_proj", "down_proj")) -> str:
    """A random PEFT LoRA adapter of the tiny served llama, written without peft."""
    from safetensors.numpy import save_file

    e, f = TINY_LLAMA["hidden_size"], TINY_LLAMA["intermediate_size"]
    d = TINY_LLAMA["head_dim"]
    dims = {"q_proj": (e, 4 * d), "v_proj": (e, 2 * d), "down_proj": (f, e)}
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(TINY_LLAMA["num_hidden_layers"]):
        for m in modules:
            block = "mlp" if m == "down_proj" else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{block}.{m}"
            d_in, d_out = dims[m]
            tensors[f"{key}.lora_A.weight"] = rng.normal(0, 1, (rank, d_in)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = rng.normal(0, 1, (d_out, rank)).astype(np.float32)
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    conf = dict(peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules=list(modules))
    (path / "adapter_config.json").write_text(json.dumps(conf))
    return str(path)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("served_lora")
    ada = write_adapter(root / "ada", 8, 1)
    srv = serve_tiny(
        root / "tiny",
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "16",
        "--lora-modules",
        f"ada={ada}",
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"},
    )
    yield srv, root
    srv.stop()


@pytest.fixture(scope="module")
def served_mesh(served):
    """The same tiny model and adapter on a `tensor=2` mesh of 2 virtual CPU devices."""
    _, root = served
    srv = serve_tiny(
        root / "tiny_mesh",
        *("--enable-lora", "--max-loras", "2", "--lora-modules", f"ada={root / 'ada'}"),
        *("--mesh", "tensor=2"),
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
    )
    yield srv
    srv.stop()


def _call(url: str, body: dict | None = None) -> tuple[int, dict | str]:
    """(status, JSON body or text) of a GET (no body) or a JSON POST."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def _complete(srv, model: str) -> tuple[int, dict]:
    body = dict(model=model, prompt="Hello there", max_tokens=2, temperature=0.0, logprobs=1)
    return _call(f"{srv.http_url}/completions", body)


def _first_logprob(out: dict) -> float:
    return out["choices"][0]["logprobs"]["token_logprobs"][0]


def test_adapters_served_listed_loaded_and_unloaded(served):
    srv, root = served
    cards = {c["id"]: c for c in _call(f"{srv.http_url}/models")[1]["data"]}
    base_id = next(i for i, c in cards.items() if "parent" not in c)
    assert cards["ada"]["parent"] == base_id and cards["ada"]["root"].endswith("ada")

    (s_base, base), (s_ada, ada) = _complete(srv, base_id), _complete(srv, "ada")
    assert s_base == s_ada == 200, ada
    lp = [_first_logprob(base), _first_logprob(ada)]
    assert abs(lp[0] - lp[1]) > 1e-3  # the adapter changes the model
    assert ada["model"] == "ada"

    status, missing = _complete(srv, "nope")
    assert status == 404 and missing["error"]["param"] == "model"

    url = srv.http_url.removesuffix("/v1")
    adb = write_adapter(root / "adb", 16, 2, modules=("q_proj",))
    big = write_adapter(root / "big", 32, 3)
    for body, param in [
        ({"lora_name": "adb2", "lora_path": str(root / "none")}, "lora_path"),
        ({"lora_name": "big", "lora_path": big}, "max_lora_rank"),
        ({"lora_name": "ada", "lora_path": adb}, "lora_name"),
    ]:
        status, out = _call(f"{url}/v1/load_lora_adapter", body)
        assert status == 400 and out["error"]["param"] == param, out
    status, out = _call(f"{url}/v1/load_lora_adapter", {"lora_name": "adb", "lora_path": adb})
    assert status == 200, out
    status, got = _complete(srv, "adb")
    assert status == 200, got
    assert _first_logprob(got) not in lp
    # Unloaded while a request streams under it: the stream finishes under it, the core frees
    # the adapter's slot once it has (a `RemoveLoRA` message; its log line says so).
    with _stream(srv, "adb", 200) as stream:
        assert stream.readline().startswith(b"data:")
        status, out = _call(f"{url}/v1/unload_lora_adapter", {"lora_name": "adb"})
        assert status == 200, out
        assert _complete(srv, "adb")[0] == 404
        chunks = [
            json.loads(x[5:]) for x in stream.read().split(b"\n") if x[5:].strip()[:1] == b"{"
        ]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    deadline = time.monotonic() + 60
    while not any("unloaded, its slot freed once" in x for x in srv.log):
        assert time.monotonic() < deadline, "".join(srv.log[-20:])
        time.sleep(0.05)
    assert "adb" not in {c["id"] for c in _call(f"{srv.http_url}/models")[1]["data"]}


def _stream(srv, model: str, tokens: int):
    body = dict(model=model, prompt="Hi", max_tokens=tokens, ignore_eos=True, stream=True)
    req = urllib.request.Request(
        f"{srv.http_url}/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    return urllib.request.urlopen(req, timeout=120)


def _metrics(srv) -> str:
    with urllib.request.urlopen(srv.http_url.removesuffix("/v1") + "/metrics", timeout=30) as r:
        return r.read().decode()


def _lora_count(text: str, name: str) -> float:
    m = re.search(rf'^jaxinfer_lora_requests_total{{lora_name="{name}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_lora_metrics(served):
    """vLLM's `vllm:lora_requests_info` (max_lora, running/waiting adapter names, value = time of
    the last step) while an adapter's request streams; per-adapter request counts."""
    srv, _ = served
    before = _lora_count(_metrics(srv), "ada")
    with _stream(srv, "ada", 200) as stream:
        assert stream.readline().startswith(b"data:")  # a step with the request running is seen
        text = _metrics(srv)
    (info,) = re.findall(r"^vllm:lora_requests_info\{(.*)\} (\S+)$", text, re.M)
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info[0]))
    assert labels == {"max_lora": "2", "running_lora_adapters": "ada", "waiting_lora_adapters": ""}
    assert abs(float(info[1]) - time.time()) < 600
    assert _lora_count(text, "ada") == before + 1
    assert _complete(srv, "ada")[0] == 200
    assert _lora_count(_metrics(srv), "ada") == before + 2


def test_grpc_lora_name(served):
    """gRPC `lora_name` runs the adapter as the HTTP `model` field does; an unknown name is
    INVALID_ARGUMENT naming lora_name."""
    import grpc

    from serving.protos.jaxinfer.v1 import generate_pb2 as pb
    from serving.protos.jaxinfer.v1 import generate_pb2_grpc as pb_grpc

    srv, _ = served
    sampling = pb.SamplingParams(max_tokens=2, temperature=0.0, logprobs=0)
    with grpc.insecure_channel(srv.grpc_address) as channel:
        stub = pb_grpc.GenerateServiceStub(channel)

        def first_logprob(**kw) -> float:
            req = pb.GenerateRequest(prompt="Hello there", sampling=sampling, **kw)
            return stub.GenerateOnce(req, timeout=120).logprobs[0].logprob

        ada, base = first_logprob(lora_name="ada"), first_logprob()
        status, out = _complete(srv, "ada")
        assert status == 200 and abs(ada - _first_logprob(out)) < 1e-4
        assert abs(ada - base) > 1e-3
        with pytest.raises(grpc.RpcError) as info:
            first_logprob(lora_name="nope")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "lora_name" in info.value.details()


def test_adapter_on_tensor_mesh_matches_one_device(served, served_mesh):
    """`--enable-lora --mesh tensor=2`: the adapter's stacks split as their base weights; greedy
    tokens equal the one-device server's and their logprobs agree to f32 rounding."""
    body = dict(model="ada", prompt="Hello there", max_tokens=8, temperature=0.0, logprobs=1)
    outs = []
    for srv in (served[0], served_mesh):
        status, out = _call(f"{srv.http_url}/completions", body)
        assert status == 200, out
        outs.append(out["choices"][0]["logprobs"])
    assert outs[0]["tokens"] == outs[1]["tokens"]
    np.testing.assert_allclose(outs[1]["token_logprobs"], outs[0]["token_logprobs"], atol=1e-4)
