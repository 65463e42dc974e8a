"""Multi-host serving: 2 processes x 4 virtual CPU devices on loopback (jaxinfer/engine/multihost.py).

1. A tiny random Llama (8 heads, so `tensor=8` divides it) is saved once as a HF dir with a
   WordLevel tokenizer (and converted to orbax); every process loads it from there, as serve.py
   would.
2. `tests/multihost_worker.py` runs as process 0 (leader: engine, scheduler) and process 1
   (follower) on a free port, with meshes `tensor=8`, `data=2,tensor=4` and `pipeline=2,tensor=4`
   over both processes' devices; both must exit 0, the follower on the leader's SHUTDOWN.
3. Checked: a psum over both processes' devices, step-channel round trips (one-frame and
   two-broadcast payloads), a configuration that differs between processes failing on both, the
   leader's greedy tokens == one single-process engine's, and the follower ran exactly the
   leader's steps with the same inputs (it sampled the same tokens).
4. `scripts/serve.py` twice (process 0 serves gRPC, process 1 follows with different flags, which
   it must replace by process 0's): a client gets the single-process tokens; SIGTERM to process 0
   shuts both down with exit 0.
5. Pure-host checks of the channel's framing need no second process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxinfer.engine import multihost

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKER = REPO_ROOT / "tests" / "multihost_worker.py"
sys.path.insert(0, str(REPO_ROOT / "tests"))
import multihost_worker as worker  # noqa: E402

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=8,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_tiny_model(root: Path) -> Path:
    """A tiny random Llama as a HF dir (safetensors + config + tokenizer.json)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import tokenizers
    from tokenizers import models, pre_tokenizers

    config = transformers.LlamaConfig(**TINY)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            scale, base = (0.1, 1.0) if p.ndim == 1 else (0.15, 0.0)
            p.copy_(base + scale * torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(root), safe_serialization=True)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(TINY["vocab_size"] - 3)]
    tok = tokenizers.Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    )
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return root


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny_hf"))


@pytest.fixture(scope="module")
def tiny_orbax(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same model converted to orbax (each process restores only its devices' shards)."""
    from jaxinfer.convert import convert

    return Path(convert(tiny_dir, tmp_path_factory.mktemp("tiny_orbax") / "tiny"))


@pytest.fixture(scope="module")
def single_process_tokens(tiny_dir: Path) -> list[list[int]]:
    """The greedy tokens of one process, one device: the reference for every multi-host run."""
    from jaxinfer.config import EngineConfig
    from jaxinfer.engine.engine import LLMEngine, wait_all
    from jaxinfer.loader import load_model
    from jaxinfer.sampling_params import SamplingParams

    engine = LLMEngine(load_model(str(tiny_dir)), EngineConfig(**worker.ENGINE))
    for i, ids in enumerate(worker.PROMPTS):
        engine.add_request(
            ids,
            SamplingParams(temperature=0.0, max_tokens=worker.MAX_TOKENS, ignore_eos=True),
            request_id=f"p{i}",
        )
    tokens: dict[str, list[int]] = {}
    for d in wait_all(engine, timeout=300):
        tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
    return [tokens[f"p{i}"] for i in range(len(worker.PROMPTS))]


def run_two_processes(model: Path, out: Path, mesh: str = "", timeout: float = 420) -> list[dict]:
    """Runs the worker as processes 0 and 1; both must exit 0. Returns their reports."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the worker sets its own
    procs = []
    for pid in (0, 1):
        cmd = [
            sys.executable,
            str(WORKER),
            "--port",
            str(port),
            "--process-id",
            str(pid),
            "--model",
            str(model),
            "--out",
            str(out),
        ] + (["--mesh", mesh] if mesh else [])
        log = open(out / f"process_{pid}.log", "w")  # noqa: SIM115 - closed in the finally below
        procs.append(
            (
                subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT),
                log,
            )
        )
    try:
        for pid, (proc, _) in enumerate(procs):
            rc = proc.wait(timeout=timeout)
            assert rc == 0, (
                f"process {pid} exited {rc}:\n" + (out / f"process_{pid}.log").read_text()[-4000:]
            )
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    return [json.loads((out / f"process_{pid}.json").read_text()) for pid in (0, 1)]


def check_reports(reports: list[dict], expected_tokens: list[list[int]]) -> None:
    leader, follower = reports
    assert [r["process_index"] for r in reports] == [0, 1]
    assert all(r["device_count"] == 8 and r["local_device_count"] == 4 for r in reports)
    assert all(r["psum"] == 28.0 for r in reports)  # 0 + 1 + ... + 7 over both processes
    assert all(r["round_trip_ok"] for r in reports)
    assert all(r["mismatch_detected"] for r in reports)
    # The small payload fits one frame, the large one needs a second broadcast.
    assert leader["broadcasts"] == follower["broadcasts"] == 3
    assert leader["tokens"] == expected_tokens
    assert follower["followed"] == len(leader["steps"]) > 0
    assert follower["steps"] == leader["steps"]  # same inputs, same step: same samples
    assert leader["messages"] == follower["messages"]
    assert leader["compiled"] == follower["compiled"] > 0  # the follower warmed up with the leader


@pytest.mark.slow
# NOTE: two meshes keep the suite within its time budget; tensor=8 is inside data=2,tensor=4.
@pytest.mark.parametrize(
    "mesh,source", [("data=2,tensor=4", "orbax"), ("pipeline=2,tensor=4", "hf")]
)
def test_two_processes_on_a_global_mesh_match_one_process(
    tiny_dir, single_process_tokens, tmp_path, request, mesh, source
):
    """2 x 4 devices on one mesh. The leading mesh axis splits by process: with data=2 each
    process holds one replica (results all-gathered), with pipeline=2 one stage (activations
    cross processes). The HF dir and its orbax conversion both load multi-process."""
    model = tiny_dir if source == "hf" else request.getfixturevalue("tiny_orbax")
    reports = run_two_processes(model, tmp_path, mesh)
    check_reports(reports, single_process_tokens)


@pytest.mark.slow
def test_serve_script_two_processes_sigterm_stops_both(tiny_dir, single_process_tokens, tmp_path):
    """serve.py x 2: process 0 serves gRPC on mesh tensor=8, process 1 follows; SIGTERM to 0 ends both."""
    from serving.client import GenerateClient

    port = _free_port()
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    common = [
        "--model",
        str(tiny_dir),
        "--mesh",
        "tensor=8",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--no-metrics",
        "--coordinator-address",
        f"127.0.0.1:{port}",
        "--num-processes",
        "2",
        "--page-size",
        str(worker.ENGINE["page_size"]),
        "--num-pages",
        str(worker.ENGINE["num_pages"]),
        "--max-model-len",
        str(worker.ENGINE["max_model_len"]),
        "--max-num-seqs",
        str(worker.ENGINE["max_num_seqs"]),
        "--max-num-batched-tokens",
        str(worker.ENGINE["max_num_batched_tokens"]),
    ]
    logs = [tmp_path / f"serve_{pid}.log" for pid in (0, 1)]
    procs = []
    for pid in (0, 1):
        # The follower's own flags differ on purpose: it must adopt process 0's.
        extra = ["--max-num-seqs", "2"] if pid else []
        with open(logs[pid], "w") as log:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(REPO_ROOT / "scripts" / "serve.py"),
                        *common,
                        *extra,
                        "--process-id",
                        str(pid),
                    ],
                    cwd=REPO_ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    try:
        deadline = time.monotonic() + 400
        grpc_port = None
        while grpc_port is None:
            assert procs[0].poll() is None, logs[0].read_text()[-4000:]
            assert time.monotonic() < deadline, logs[0].read_text()[-4000:]
            m = re.search(r"listening on 127\.0\.0\.1:(\d+)", logs[0].read_text())
            grpc_port = m and m.group(1)
            time.sleep(0.5)
        with GenerateClient(f"127.0.0.1:{grpc_port}") as client:
            client.wait_ready(400)
            for ids, want in zip(worker.PROMPTS, single_process_tokens, strict=True):
                got = client.generate_once(
                    ids, max_tokens=worker.MAX_TOKENS, temperature=0.0, ignore_eos=True, timeout=120
                )
                assert list(got.token_ids) == want
        procs[0].send_signal(signal.SIGTERM)
        for pid, proc in enumerate(procs):
            assert proc.wait(120) == 0, logs[pid].read_text()[-4000:]
        assert "using process 0's 4 (not 2)" in logs[1].read_text()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_channel_frames_and_size_classes(monkeypatch):
    """The leader's frames decode on a follower: header, inline payload, and the large path."""
    sent: list[np.ndarray] = []
    monkeypatch.setattr(multihost, "_broadcast", lambda buf: sent.append(buf.copy()) or buf)
    monkeypatch.setattr(multihost, "is_leader", lambda: True)
    leader = multihost.StepChannel()
    small = {"x": np.arange(3)}
    packable = {"z": np.zeros((64, 128), np.int32)}  # 32 KiB raw: compressed into one frame
    large = {"y": np.random.default_rng(0).integers(0, 2**62, 10_000)}  # incompressible 80 KB
    leader.send(multihost.RUN, small)
    leader.send(multihost.RUN, packable)
    leader.send(multihost.DATA, large)
    leader.shutdown()
    leader.shutdown()  # idempotent
    frame = multihost.FRAME_BYTES
    assert [len(b) for b in sent] == [frame, frame, frame, 1 << 17, frame]
    with pytest.raises(multihost.ChannelError, match="shut down"):
        leader.send(multihost.RUN, small)

    replay = iter(sent)
    monkeypatch.setattr(multihost, "_broadcast", lambda buf: next(replay))
    monkeypatch.setattr(multihost, "is_leader", lambda: False)
    follower = multihost.StepChannel()
    control, got = follower.recv()
    assert control == multihost.RUN and np.array_equal(got["x"], small["x"])
    control, got = follower.recv()
    assert control == multihost.RUN and np.array_equal(got["z"], packable["z"])
    control, got = follower.recv()
    assert control == multihost.DATA and np.array_equal(got["y"], large["y"])
    assert follower.recv() == (multihost.SHUTDOWN, None) and follower.closed


def test_channel_detects_processes_out_of_step(monkeypatch):
    monkeypatch.setattr(multihost, "is_leader", lambda: True)
    frames: list[np.ndarray] = []
    monkeypatch.setattr(multihost, "_broadcast", lambda buf: frames.append(buf.copy()) or buf)
    leader = multihost.StepChannel()
    leader.send(multihost.RUN, 1)
    leader.send(multihost.RUN, 2)
    monkeypatch.setattr(multihost, "is_leader", lambda: False)
    monkeypatch.setattr(multihost, "_broadcast", lambda buf: frames[1])  # message 0 was missed
    with pytest.raises(multihost.ChannelError, match="fell out of step"):
        multihost.StepChannel().recv()
    monkeypatch.setattr(multihost, "_broadcast", lambda buf: np.zeros_like(buf))
    with pytest.raises(multihost.ChannelError, match="corrupt"):
        multihost.StepChannel().recv()


def test_initialize_rejects_bad_flags():
    with pytest.raises(ValueError, match="--process-id"):
        multihost.initialize("127.0.0.1:1234", 2, 2)
    with pytest.raises(ValueError, match="--num-processes"):
        multihost.initialize("127.0.0.1:1234", 0, 0)
    with pytest.raises(ValueError, match="host:port"):
        multihost.initialize("localhost", 2, 0)
