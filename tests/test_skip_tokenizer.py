"""`skip_tokenizer_init=True` (vLLM's name): token ids in and out, no tokenizer anywhere.

1. A tokenizer-less HF dir (a tiny random DeepSeek-V2) fails to load by default and loads with
   `LLM(..., skip_tokenizer_init=True)`; greedy generation from token ids equals HF's
   `generate` (same tokens, stopping at the config's `eos_token_id`), text fields are empty.
   Text prompts, stop strings and `chat` raise saying why.
2. The gRPC server over an engine without a tokenizer (fake runner): token-id requests stream
   ids with empty text; text prompts, chat messages, stop strings and Tokenize are
   INVALID_ARGUMENT naming the flag; ModelInfo reports the config's EOS and no chat template.
3. `serve.py --skip-tokenizer-init` as serve.py builds it: the flag reaches the front end (no
   tokenizer) and the spawned engine-core process, which loads the tokenizer-less dir and
   streams HF's greedy ids.
"""

from __future__ import annotations

import os
import sys

import grpc
import numpy as np
import pytest

from jaxinfer.config import ModelConfig
from jaxinfer.model_info import LoadedModel
from jaxinfer.sampling_params import SamplingParams
from serving.client import GenerateClient, build_request
from serving.protos.jaxinfer.v1 import generate_pb2 as pb
from serving.server import GenerateServer
from serving.testing import FakeRunner, ServerThread, fake_stream

EOS = 7
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.model_utils import make_hf_model

    model, config = make_hf_model(
        "deepseek_v2", eos_token_id=EOS, bos_token_id=None, pad_token_id=None
    )
    path = tmp_path_factory.mktemp("ds_no_tokenizer")
    model.save_pretrained(path, safe_serialization=True)
    assert not any(p.name.startswith("tokenizer") for p in path.iterdir())
    return path, model


def test_tokenizer_less_dir_needs_the_flag(hf_dir):
    from jaxinfer.loader import load_model

    path, _ = hf_dir
    with pytest.raises(Exception, match="tokenizer"):
        load_model(path)
    loaded = load_model(path, skip_tokenizer_init=True)
    assert loaded.tokenizer is None and loaded.eos_token_ids == (EOS,)


def _prompts() -> list[list[int]]:
    return [
        [int(t) for t in np.random.default_rng(s).integers(10, 256, n)] for s, n in ((1, 9), (2, 5))
    ]


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    import torch

    with torch.no_grad():
        return model.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=EOS,
        )[0, len(prompt) :].tolist()


def test_llm_generates_token_ids_like_hf(hf_dir):
    from jaxinfer.llm import LLM

    path, model = hf_dir
    llm = LLM(
        str(path),
        skip_tokenizer_init=True,
        page_size=4,
        num_pages=48,
        max_model_len=64,
        max_num_seqs=2,
        max_num_batched_tokens=16,
    )
    prompts = _prompts()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    for prompt, out in zip(prompts, outs):
        ref = _hf_greedy(model, prompt, 12)
        assert out.token_ids == ref
        assert out.text == "" and out.finish_reason == ("stop" if ref[-1] == EOS else "length")
    with pytest.raises(ValueError, match="token ids"):
        llm.generate("some text")
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([prompts[0]], SamplingParams(max_tokens=2, stop=["x"]))
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        llm.chat([{"role": "user", "content": "hi"}])


@pytest.fixture(scope="module")
def srv():
    hf = dict(
        model_type="llama",
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        vocab_size=5000,
        max_position_embeddings=4096,
        eos_token_id=[3, 4],
    )
    model = LoadedModel(
        name="no-tok",
        path="<fake>",
        source="fake",
        cfg=ModelConfig.from_hf(hf),
        hf_config=hf,
        params=None,
        tokenizer=None,
        dtype="float32",
    )
    from jaxinfer.config import EngineConfig
    from jaxinfer.engine.engine import LLMEngine

    engine = LLMEngine(
        model,
        EngineConfig(
            page_size=16,
            num_pages=129,
            max_model_len=512,
            max_num_seqs=8,
            max_num_batched_tokens=64,
        ),
    )
    engine.runner = FakeRunner()
    st = ServerThread(GenerateServer(engine, metrics_port=None, warmup=False))
    yield st
    st.stop()


def test_server_without_tokenizer(srv):
    client = GenerateClient(srv.address)
    try:
        info = client.model_info()
        assert list(info.eos_token_ids) == [3, 4] and not info.has_chat_template
        assert info.vocab_size == 5000
        ids = [1000, 1500, 2000]
        msgs = list(client.stub.Generate(build_request(ids, max_tokens=6, ignore_eos=True)))
        got = [t for m in msgs for t in m.token_ids]
        assert got == fake_stream(ids, 6)
        assert all(m.text == "" for m in msgs)
        cases = {
            "prompt": build_request("hello", max_tokens=2),
            "messages": build_request([{"role": "user", "content": "hi"}], max_tokens=2),
            "sampling.stop": build_request(ids, max_tokens=2, stop=["x"]),
            "sampling.structured_outputs": build_request(ids, max_tokens=2),
        }
        cases["sampling.structured_outputs"].sampling.structured_outputs.regex = "[a-z]+"
        for needle, req in cases.items():
            with pytest.raises(grpc.RpcError) as err:
                list(client.stub.Generate(req))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert needle in err.value.details() and "skip-tokenizer-init" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            client.stub.Tokenize(pb.TokenizeRequest(text="hi"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "skip-tokenizer-init" in err.value.details()
    finally:
        client.close()


def test_serve_flag_reaches_front_end_and_core_process(hf_dir, monkeypatch):
    import logging

    from jaxinfer.engine.core_client import CoreSpec, ProcessCoreClient
    from serving.launch import EngineArgs, build_core, frontend_model

    monkeypatch.setattr(logging, "basicConfig", lambda **kw: None)
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import serve
    finally:
        sys.path.pop(0)
    path, model = hf_dir
    argv = [
        "--model",
        str(path),
        "--page-size",
        "4",
        "--num-pages",
        "48",
        "--max-model-len",
        "64",
        "--max-num-seqs",
        "2",
        "--max-num-batched-tokens",
        "16",
        "--no-warmup",
    ]
    with pytest.raises(Exception, match="tokenizer"):  # without the flag the front end refuses
        frontend_model(serve.engine_args(serve.build_parser().parse_args(argv)))
    args = serve.build_parser().parse_args([*argv, "--skip-tokenizer-init"])
    eargs = serve.engine_args(args)
    assert eargs.skip_tokenizer_init and "skip_tokenizer_init" in serve.ENGINE_FLAGS
    front = frontend_model(eargs)
    assert front.tokenizer is None and front.eos_token_ids == (EOS,)
    with pytest.raises(ValueError, match="fake_runner"):
        EngineArgs(model=str(path), fake_runner=True, skip_tokenizer_init=True)
    client = ProcessCoreClient(CoreSpec(build_core, {"args": eargs}, serve.loop_options(args)))
    st = ServerThread(
        GenerateServer(model=front, core=client, max_num_seqs=2, metrics_port=None), timeout=240
    )
    try:
        gc = GenerateClient(st.address)
        try:
            assert list(gc.model_info().eos_token_ids) == [EOS]
            for prompt in _prompts():
                msgs = list(gc.stub.Generate(build_request(prompt, max_tokens=8, temperature=0.0)))
                assert [t for m in msgs for t in m.token_ids] == _hf_greedy(model, prompt, 8)
                assert all(m.text == "" for m in msgs)
        finally:
            gc.close()
    finally:
        st.stop()
