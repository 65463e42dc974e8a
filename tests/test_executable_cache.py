"""The executable cache (jaxinfer/executable_cache.py): a restarted runner traces nothing.

1. A runner's warmup over an empty cache directory stores one executable per program; a second
   runner over the same directory loads every one of them, traces and compiles none of them
   (JAX's own monitoring events), and gives the same tokens, split sampling included.
2. Another configuration (KV-cache dtype, activation dtype) or another source hash is another key: nothing loads.
3. A corrupt entry is logged once and compiled again (and the tokens are still the same).
4. With `cache_first_use` (the served engine core), a runner without warmup stores what its calls
   compile and the next one loads it on first use (nothing traced); an executable JAX read from
   its own persistent cache is not stored. int4 weights too.
"""

import logging
import pickle

import jax
import numpy as np
import pytest
from jax._src.dispatch import BACKEND_COMPILE_EVENT, JAXPR_TRACE_EVENT
from test_runner import SMALL, drive, req, small_runner

from jaxinfer import compile_cache, executable_cache, quantization
from jaxinfer.config import ModelConfig
from jaxinfer.models import llama
from jaxinfer.params import init_random


@pytest.fixture(scope="module")
def small():
    cfg = ModelConfig.from_hf(SMALL)
    params = init_random(llama.param_specs(cfg), jax.random.key(0))
    return cfg, jax.device_put(params, jax.devices()[0])


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("xla")


@pytest.fixture
def in_cache_dir(cache_dir, monkeypatch):
    """The runners' executable cache under `cache_dir` (the process's own JAX cache untouched)."""
    monkeypatch.setattr(compile_cache, "active_dir", lambda: str(cache_dir))
    return cache_dir / executable_cache.SUBDIR


@pytest.fixture(scope="module")
def first(small, cache_dir):
    """A cold runner: warmup stores its programs; (runner, its tokens)."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(compile_cache, "active_dir", lambda: str(cache_dir))
        runner = small_runner(small)
        before = executable_cache.counts()
        runner.warmup(structured=True)
    after = executable_cache.counts()
    assert after["loaded"] == before["loaded"]
    assert after["stored"] - before["stored"] == runner.num_compiled == 3  # 2 steps, 1 sampler
    return runner, run(runner)


def run(runner) -> tuple:
    """Greedy tokens of a few requests, fused and split (structured output's sampler) steps."""
    fused = [(0, req("a", [5, 6, 7], max_tokens=3)), (1, req("b", list(range(40, 52))))]
    split = [(0, req("c", [5, 6, 7], max_tokens=3)), (1, req("d", [8, 9]))]
    return drive(runner, fused), drive(runner, split, split=True)


def program_events() -> tuple[list, callable]:
    """Every trace and compile of a runner program (step or sampler) while listening."""
    events: list[tuple[str, str]] = []

    def listener(event: str, duration: float, **kw) -> None:
        name = str(kw.get("fun_name"))
        if event in (JAXPR_TRACE_EVENT, BACKEND_COMPILE_EVENT) and "program" in name:
            events.append((event, name))

    jax.monitoring.register_event_duration_secs_listener(listener)
    return events, lambda: jax.monitoring.unregister_event_duration_listener(listener)


def test_restart_loads_every_program_and_traces_nothing(small, first, in_cache_dir) -> None:
    runner, tokens = first
    assert len(list(in_cache_dir.glob("*.jexe"))) == runner.num_compiled
    events, stop = program_events()
    try:
        before = executable_cache.counts()["loaded"]
        again = small_runner(small)
        assert again.warmup(structured=True) == runner.num_compiled
        assert executable_cache.counts()["loaded"] - before == runner.num_compiled
        assert run(again) == tokens
    finally:
        stop()
    assert events == []
    assert again.compiled_program_count() == runner.num_compiled


def warmup_keys(runner) -> list[str]:
    """The executable-cache keys of the runner's step programs."""
    keys = []
    for t_bucket, p_bucket, all_logits, width in runner.buckets.warmup_plan():
        inputs = runner.inputs.idle_inputs(t_bucket, all_logits, p_bucket, width)
        keys.append(runner._steps.disk_key(*runner._args(inputs, all_logits)))
    return keys


def test_another_config_or_source_misses(small, first, in_cache_dir, monkeypatch, tmp_path):
    cache = executable_cache.ExecutableCache.open()
    keys = warmup_keys(small_runner(small))
    assert all(cache.load(k) is not None for k in keys)  # what `first` stored
    for other in (dict(kv_cache_dtype="fp8"), dict(dtype="bfloat16")):
        assert all(cache.load(k) is None for k in warmup_keys(small_runner(small, **other)))
    # another source tree hashes otherwise, and the key holds the hash
    (tmp_path / "jaxinfer").mkdir()
    (tmp_path / "jaxinfer" / "a.py").write_text("x = 1\n")
    one = executable_cache.hash_sources(tmp_path)
    (tmp_path / "jaxinfer" / "a.py").write_text("x = 2\n")
    assert executable_cache.hash_sources(tmp_path) != one
    assert executable_cache.source_hash() in executable_cache.environment()
    monkeypatch.setattr(executable_cache, "environment", lambda: "source=another")
    assert all(cache.load(k) is None for k in warmup_keys(small_runner(small)))


def test_corrupt_entry_is_compiled_again(small, first, in_cache_dir, caplog) -> None:
    runner, tokens = first
    entries = sorted(in_cache_dir.glob("*.jexe"), key=lambda p: p.stat().st_size)
    sampler = entries[0]  # the smallest program: the cheapest to compile again
    key, *rest = pickle.loads(sampler.read_bytes())
    assert key.startswith("program=sampler")
    sampler.write_bytes(sampler.read_bytes()[:100])
    before = executable_cache.counts()
    with caplog.at_level(logging.WARNING, logger="jaxinfer.executable_cache"):
        again = small_runner(small)
        again.warmup(structured=True)
    after = executable_cache.counts()
    assert after["loaded"] - before["loaded"] == runner.num_compiled - 1
    assert after["stored"] - before["stored"] == 1  # compiled, and written again whole
    warnings = [r.getMessage() for r in caplog.records if "unusable entry" in r.getMessage()]
    assert len(warnings) == 1 and sampler.name in warnings[0], warnings
    assert pickle.loads(sampler.read_bytes())[0] == key
    assert run(again) == tokens


@pytest.mark.parametrize("fmt", [None, "int4"])
def test_first_use_stores_and_the_next_runner_loads(small, first, tmp_path, monkeypatch, fmt):
    """int4: the uint4 codes, whose layouts the programs' check refused (`program_table._keep`),
    run on the loaded programs too (nothing traced, the jit unused)."""
    cfg, params = small
    model = cfg, quantization.quantize_params(params, llama.param_specs(cfg), fmt)
    monkeypatch.setattr(executable_cache, "_first_use", True)
    monkeypatch.setattr(compile_cache, "active_dir", lambda: str(tmp_path))
    before = executable_cache.counts()
    with compile_cache.persistent_cache_paused():  # NOTE: XLA compiles them: they are stored
        cold = small_runner(model)
        tokens = run(cold)
    assert fmt is not None or tokens == first[1]
    stored = executable_cache.counts()["stored"] - before["stored"]
    assert stored == len(list((tmp_path / executable_cache.SUBDIR).glob("*.jexe"))) >= 2
    assert cold.compiled_program_count() == stored  # one program per call signature
    assert cold._steps.jit_cache_size() == 0  # NOTE: a refused program moved there, same count
    events, stop = program_events()
    try:
        warm = small_runner(model)
        assert run(warm) == tokens
    finally:
        stop()
    assert events == []
    assert executable_cache.counts()["loaded"] - before["loaded"] == stored
    assert warm.compiled_program_count() == stored and warm._steps.jit_cache_size() == 0


def test_compiled_fresh_tells_a_persistent_cache_read() -> None:
    x = np.float32(np.random.default_rng().random())  # a constant no other program holds

    def program():
        return jax.jit(lambda y: y * x + 1).lower(np.float32(2)).compile()

    if not compile_cache.active_dir():
        pytest.skip("JAX's persistent cache is off (JAX_COMPILATION_CACHE_DIR empty)")
    assert compile_cache.compiled_fresh(program)[1]
    assert not compile_cache.compiled_fresh(program)[1]  # the same HLO: read from the cache
