"""Meshes, quantized weights and caches, and the in-process engine through the real served path.

Two `scripts/serve.py` processes over the successor model (`served_utils.successor_model_dir`:
greedy next token = last token + 1, the leader ~15 logits ahead, far above fp8 rounding), each
with several engine-shaping flags at once; every one must decode exactly the model's tokens:
1. `--engine-in-process --dtype bfloat16 --quantization fp8 --mesh data=2,pipeline=2,tensor=2`
   (8 virtual CPU devices), `--profile-port` (the profiler server listens) and
   `--grace-period 0.5` (SIGTERM aborts a long stream once it is over; checked last);
2. `--speculative-config` n-gram with `--kv-cache-dtype fp8` and `--quantization int4` (4-bit
   layer weights; the vocabulary-sized ones int8) on `--mesh expert=2,tensor=2`
   (4 devices) and `--skip-tokenizer-init`: tokens equal plain decoding, the spec metrics move,
   the text fields stay empty and a text prompt is refused naming the flag.
3. `--quantization gptq --linear-backend cpu` (vLLM's name for the checkpoint's own format) on one
   device over the successor model packed as a 4-bit act-order GPTQ checkpoint
   (`tests/packed_checkpoints.py`, desc_act=True: the loader repacks its qweight / qzeros /
   scales, groups of 32, rows sorted by g_idx): the start-up line names the loaded format
   (int4-g32-act), the int4 codes in the CPU kernel's tiles, x gathered through each weight's
   permutation, three concurrent streams decode exactly the model's tokens.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import threading
from pathlib import Path

import grpc
import pytest
from served_utils import TINY_BUCKETS, ServedProcess, successor_model_dir, successors

from serving.client import GenerateClient

pytestmark = pytest.mark.slow  # server subprocesses

V = 49152
SIZES = [
    *("--no-warmup", "--max-model-len", "256", "--max-num-seqs", "4", "--num-pages", "64"),
    *("--max-num-batched-tokens", "64", *TINY_BUCKETS),  # NOTE: two step programs per server
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return successor_model_dir(tmp_path_factory.mktemp("succ") / "succ")


@pytest.fixture(scope="module")
def profile_port():
    return _free_port()


@pytest.fixture(scope="module")
def in_process(model_dir, profile_port):
    srv = ServedProcess(
        [
            *("--model", str(model_dir), *SIZES, "--engine-in-process", "--dtype", "bfloat16"),
            *("--quantization", "fp8", "--mesh", "data=2,pipeline=2,tensor=2"),
            *("--profile-port", str(profile_port), "--grace-period", "0.5"),
        ]
    )
    yield srv
    assert srv.stop() == 0, "".join(srv.log[-30:])


@pytest.fixture(scope="module")
def ngram(model_dir):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    srv = ServedProcess(
        [
            *("--model", str(model_dir), *SIZES, "--kv-cache-dtype", "fp8"),
            *("--quantization", "int4", "--mesh", "expert=2,tensor=2"),
            *("--speculative-config", json.dumps(spec)),
            "--skip-tokenizer-init",
        ],
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
    )
    yield srv
    assert srv.stop() == 0, "".join(srv.log[-30:])


@pytest.fixture(scope="module")
def int4_cpu(model_dir, tmp_path_factory):
    from safetensors.numpy import load_file

    from tests.packed_checkpoints import write_packed

    gptq = tmp_path_factory.mktemp("gptq") / "succ"
    shutil.copytree(model_dir, gptq)
    config = json.loads((gptq / "config.json").read_text())
    sd = load_file(str(model_dir / "model.safetensors"))
    write_packed(gptq, config, sd, "gptq", 4, act_order=True)
    srv = ServedProcess(
        [
            *("--model", str(gptq), *SIZES),
            *("--quantization", "gptq", "--linear-backend", "cpu", "--skip-tokenizer-init"),
        ]
    )
    yield srv
    assert srv.stop() == 0, "".join(srv.log[-30:])


def _tokens(srv: ServedProcess, prompt: list[int], **kw) -> tuple[list[int], list]:
    with GenerateClient(srv.grpc_address) as c:
        msgs = list(c.generate(prompt, timeout=120, **kw))
    return [t for m in msgs for t in m.token_ids], msgs


def test_fp8_bf16_on_a_data_pipeline_tensor_mesh_decodes_the_models_tokens(in_process):
    got: dict[int, list[int]] = {}

    def run(last: int) -> None:
        got[last] = _tokens(in_process, [1000, last], max_tokens=10, temperature=0)[0]

    threads = [threading.Thread(target=run, args=(last,)) for last in (5000, 6000)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert got == {last: successors(last, 10, V) for last in (5000, 6000)}
    with GenerateClient(in_process.grpc_address) as c:
        info = c.model_info()
    assert info.dtype == "bfloat16"
    assert dict(info.mesh_shape) == {"data": 2, "pipeline": 2, "tensor": 2, "expert": 1}
    assert "fp8 weights" in "".join(in_process.log)


def test_engine_in_process_and_profile_port(in_process, profile_port):
    maps = Path(f"/proc/{in_process.proc.pid}/maps").read_text()
    assert "jaxlib" in maps  # JAX runs in the front end's process
    assert "engine core in this process" in "".join(in_process.log)
    with socket.create_connection(("127.0.0.1", profile_port), timeout=10):
        pass


def test_grace_period_aborts_what_is_left(in_process):
    """Last for this server: SIGTERM, then the stream in flight ends ABORTED after 0.5 s."""
    msgs: list = []
    started = threading.Event()

    def stream() -> None:
        with GenerateClient(in_process.grpc_address) as c:
            for m in c.generate([100], timeout=120, max_tokens=240, temperature=0, ignore_eos=True):
                msgs.append(m)
                started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(120)
    in_process.proc.send_signal(signal.SIGTERM)
    assert in_process.wait(60) == 0
    t.join(30)
    assert msgs[-1].finish_reason == 3  # ABORTED
    assert sum(len(m.token_ids) for m in msgs) < 240


def test_ngram_speculation_with_fp8_kv_and_int4_on_an_expert_tensor_mesh(ngram):
    """The prompt repeats 1001 1002 1003: after 1001 the n-gram proposes 1002 1003 (accepted)."""
    before = ngram.metric("jaxinfer_spec_decode_num_accepted_tokens_total")
    prompt = [1001, 1002, 1003, 1004, 1000]
    ids, msgs = _tokens(ngram, prompt, max_tokens=8, temperature=0)
    assert ids == successors(1000, 8, V)
    assert not "".join(m.text for m in msgs)  # no tokenizer: ids only
    assert ngram.metric("jaxinfer_spec_decode_num_accepted_tokens_total") > before
    with GenerateClient(ngram.grpc_address) as c:
        info = c.model_info()
    assert dict(info.mesh_shape) == {"data": 1, "pipeline": 1, "expert": 2, "tensor": 2}
    log = "".join(ngram.log)
    assert "speculative ngram" in log and "(fp8)" in log and "int4" in log
    with pytest.raises(grpc.RpcError) as e, GenerateClient(ngram.grpc_address) as c:
        list(c.generate("a text prompt", timeout=60, max_tokens=2))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "skip-tokenizer-init" in e.value.details() or "skip_tokenizer_init" in e.value.details()


def test_int4_on_the_cpu_kernel_decodes_the_models_tokens(int4_cpu):
    """One device, `--linear-backend cpu`, a 4-bit act-order GPTQ checkpoint: the loader repacks
    its codes in group order,
    the core's runner puts them in the kernel's tiles (`quantization.tile_for_cpu`) and serves
    through them (decode rows in the kernel, the prefill's XLA products untiling). NOTE: the successor model's tokens do not depend on its
    layer products' exact values (a kernel reading the tiles in the wrong order still passed):
    this checks the served path with tiles; their order is checked by test_cpu_linear_tiled."""
    got: dict[int, list[int]] = {}

    def run(last: int) -> None:
        got[last] = _tokens(int4_cpu, [1000, last], max_tokens=10, temperature=0)[0]

    threads = [threading.Thread(target=run, args=(last,)) for last in (5000, 6000, 7000)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert got == {last: successors(last, 10, V) for last in (5000, 6000, 7000)}
    assert "float32, int4-g32-act weights" in "".join(int4_cpu.log)  # what loaded, not the flag
