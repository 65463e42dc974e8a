"""`scripts/bench_generate.py --llama-cpp BUILD_DIR`: llama.cpp's own benchmark on the same GGUF.

1. The command runs `BUILD_DIR/bin/llama-bench` on the GGUF file as given (no requantized copy),
   one repetition of a prefill and a decode test, the threads asked for, JSON out.
2. A fake `llama-bench` (a script printing what the real one prints with `-o json`) stands in for
   a build: each call is one run; the row is the median of the runs after the warm-up one.
3. jaxinfer's rows carry the engine thread's CPU time per decode token (`host ms/tok`), not its
   wall time: a fake engine that spends 4 ms of CPU and sleeps 6 ms a step reads ~4.
4. `--rounds`: each round's decode medians (jaxinfer's and llama.cpp's) and the ratios within a
   round; a machine twice as slow in the second round halves both engines' tok/s there and leaves
   their ratio.
"""

import json
import os
import stat
import sys
from types import SimpleNamespace

import pytest

from tests.script_utils import script


@pytest.fixture(scope="module")
def bench():
    return script("bench_generate")


def _rows(prefill: float, decode: float) -> list[dict]:
    common = {"build_commit": "0c1e570", "model_type": "llama ?B Q4_1", "n_threads": 2}
    return [
        {**common, "n_prompt": 128, "n_gen": 0, "avg_ts": prefill, "stddev_ts": 0.0},
        {**common, "n_prompt": 0, "n_gen": 64, "avg_ts": decode, "stddev_ts": 0.0},
    ]


def test_llama_bench_runs_the_same_file_once_per_run(bench, tmp_path):
    gguf = "/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "llama-bench"
    # each call prints the next run's numbers (a counter file) and logs its arguments
    fake.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {tmp_path}/calls\n'
        f"n=$(wc -l < {tmp_path}/calls)\n"
        f"cat {tmp_path}/run_$n.json\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    runs = [(500.0, 10.0), (300.0, 140.0), (320.0, 100.0), (310.0, 120.0)]  # run 0 warms up
    for i, (p, d) in enumerate(runs, 1):
        (tmp_path / f"run_{i}.json").write_text(json.dumps(_rows(p, d)))
    args = SimpleNamespace(prompt_len=128, decode_tokens=64)
    peer = bench.LlamaCpp(str(tmp_path), gguf, args, threads=2)
    assert peer.command == [
        os.path.join(str(tmp_path), "bin", "llama-bench"),
        *("-m", gguf, "-p", "128", "-n", "64", "-r", "1", "-t", "2", "-o", "json"),
    ]
    for _ in runs:
        peer()
    assert (tmp_path / "calls").read_text().splitlines()[0] == " ".join(peer.command[1:])
    got = peer.result()
    assert got["prefill_tok_s"] == 310.0 and got["decode_tok_s"] == 120.0  # medians of runs 1-3
    assert got["model_type"] == "llama ?B Q4_1" and got["threads"] == 2
    assert "(x3)" in got["command"]
    assert got["per_round_decode_tok_s"] == [120.0]  # one round of the three runs
    peer.per_round_runs = 1
    assert peer.result()["per_round_decode_tok_s"] == [140.0, 100.0, 120.0]


def test_parse_llama_bench_needs_both_tests(bench):
    rows = _rows(300.0, 140.0)
    assert bench.parse_llama_bench(json.dumps(rows))["decode_tok_s"] == 140.0
    with pytest.raises(ValueError, match="no prefill and decode tests"):
        bench.parse_llama_bench(json.dumps(rows[:1]))


class _Clock:
    """The bench's `time` in these tests: wall and thread CPU seconds the fake engine spends."""

    def __init__(self):
        self.wall = self.cpu = 0.0

    def perf_counter(self):
        return self.wall

    def thread_time(self):
        return self.cpu


class _FakeEngine:
    """Returns `per_step` tokens every step (a multi-step program's several); each step spends
    `cpu` s of this thread's CPU and `idle` s waiting (as a step waiting for the device does),
    on `clock`."""

    def __init__(self, clock, tokens: int, cpu: float, idle: float, per_step: int = 1):
        self.clock, self.tokens, self.cpu, self.idle = clock, tokens, cpu, idle
        self.per_step, self.left = per_step, 0
        self.runner = SimpleNamespace(params={}, linear_backend="cpu")

    def add_request(self, prompt_ids, sp, request_id):
        self.left = self.tokens

    def has_unfinished(self):
        return self.left > 0

    def step(self):
        self.clock.cpu += self.cpu
        self.clock.wall += self.cpu + self.idle
        n = min(self.per_step, self.left)
        self.left -= n
        return [SimpleNamespace(new_token_ids=[1] * n)]


def test_host_ms_per_token_counts_the_engine_threads_cpu_not_its_waits(bench, monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(bench, "time", clock)
    engine = _FakeEngine(clock, tokens=12, cpu=0.004, idle=0.006)
    fake = SimpleNamespace(
        engine=engine, model=SimpleNamespace(cfg=SimpleNamespace(vocab_size=100))
    )
    monkeypatch.setattr(bench, "LLM", lambda *a, **k: fake)
    monkeypatch.setattr(bench, "weight_bytes", lambda llm: 1)
    args = SimpleNamespace(
        prompt_len=8, decode_tokens=12, runs=2, model=None, dtype=None, load_format="dummy"
    )
    ((prefill, decode, nbytes, name, host_ms, _),) = bench.bench_jaxinfer(
        args, list(range(8)), [("int4", "cpu", "async", 1)]
    )
    assert name == "int4, cpu, async" and nbytes == 1
    # the 4 ms of CPU a token, not the 10 ms of wall; a token every 10 ms of wall
    assert host_ms == pytest.approx(4.0) and decode == pytest.approx(100.0)
    # a step returning 4 tokens (num_scheduler_steps): both per token, not per step
    engine.per_step = 4
    ((_, decode, _, name, host_ms, _),) = bench.bench_jaxinfer(
        args, list(range(8)), [("int4", "cpu", "async", 4)]
    )
    assert name == "int4, cpu, async, 4 steps"
    assert host_ms == pytest.approx(1.0) and decode == pytest.approx(400.0), (host_ms, decode)


def test_rounds_report_each_rounds_medians_and_ratios(bench, monkeypatch, capsys):
    """Two engines (100 and 200 tok/s), two rounds of two runs; after round 1 every step takes
    twice as long (a slow phase of the machine): per round 100 / 50 and 200 / 100 tok/s, the
    ratio 2.0 in both rounds and its median 2.0; the table's rows the medians of all four runs."""
    clock = _Clock()
    monkeypatch.setattr(bench, "time", clock)
    engines = iter(
        [_FakeEngine(clock, 12, cpu=0.004, idle=0.006), _FakeEngine(clock, 12, 0.002, 0.003)]
    )
    made = []

    def fake_llm(*args, **kwargs):
        made.append(next(engines))
        return SimpleNamespace(
            engine=made[-1], model=SimpleNamespace(cfg=SimpleNamespace(vocab_size=100))
        )

    monkeypatch.setattr(bench, "weight_bytes", lambda llm: 1 << 20)
    monkeypatch.setattr(bench, "read_bandwidth", lambda nbytes: 1e9)
    real_jaxinfer = bench.bench_jaxinfer

    def slowing(args, prompt_ids, configs, peers=()):
        calls = []

        def slow_after_round_1():  # a peer: called after every run, the compiling run 0 first
            calls.append(1)
            if len(calls) == 1 + args.runs:
                for e in made:
                    e.cpu, e.idle = 2 * e.cpu, 2 * e.idle

        return real_jaxinfer(args, prompt_ids, configs, peers=[*peers, slow_after_round_1])

    monkeypatch.setattr(bench, "LLM", fake_llm)
    monkeypatch.setattr(bench, "bench_jaxinfer", slowing)
    argv = ["bench_generate.py", "--load-format", "dummy", "--no-hf", "--prompt-len", "8"]
    argv += ["--decode-tokens", "12", "--runs", "2", "--rounds", "2", "--quantization", "a,b"]
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    out = capsys.readouterr().out
    got = json.loads(out.strip().splitlines()[-1])
    assert got["rounds"] == 2 and got["runs"] == 2
    rows = got["jaxinfer"]
    (a, b) = rows
    assert rows[a]["per_round_decode_tok_s"] == [100.0, 50.0]
    assert rows[b]["per_round_decode_tok_s"] == [200.0, 100.0]
    # the table's row: 1 / the median of the four runs' 10, 10, 20 and 20 ms a token
    assert rows[a]["decode_tok_s"] == pytest.approx(66.7, abs=0.1)
    ((name, ratio),) = got["ratios"].items()
    assert name == f"{b} / {a}"
    assert ratio == {"per_round": [2.0, 2.0], "median": 2.0}
    assert "round 2: " in out and f"{name}: median 2.00 over 2 rounds" in out


def test_round_ratios_pair_every_row_with_the_first_and_with_each_peer(bench):
    rows = [("a", [100.0, 50.0]), ("b", [200.0, 90.0])]
    got = bench.round_ratios(rows, [("l", [80.0, 40.0])])
    assert got == {"b / a": [2.0, 1.8], "a / l": [1.25, 1.25], "b / l": [2.5, 2.25]}


@pytest.mark.parametrize("flag", ["--rounds", "--runs"])
def test_rounds_and_runs_below_one_are_refused_by_name(bench, monkeypatch, capsys, flag):
    monkeypatch.setattr(sys, "argv", ["bench_generate.py", flag, "0"])
    with pytest.raises(SystemExit):
        bench.main()
    assert f"{flag} 0" in capsys.readouterr().err
