"""A warmed program's direct call (`runner.direct_call`): the same results as the checked call,
donation kept, and the checked call again whenever an argument differs from the first call's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine.runner import direct_call
from jaxinfer.engine.runner.direct_call import DirectCall
from jaxinfer.engine.runner.program_table import ProgramTable


def _step(weights, cache, x):
    """A step's shape: weights (a pytree, not donated), a donated cache, host inputs."""
    y = weights["w"] @ x[:4] + weights["b"][0] + x.sum()
    return {"y": y, "sum": cache.sum()}, cache + y[: cache.shape[0]]


def _want(weights, cache, x):
    y = np.asarray(weights["w"]) @ x[:4] + np.asarray(weights["b"][0]) + x.sum()
    return y, np.asarray(cache).sum(), np.asarray(cache) + y[: cache.shape[0]]


@pytest.fixture
def table():
    jitted = jax.jit(_step, donate_argnums=(1,))
    rng = np.random.default_rng(0)
    weights = {"w": jnp.asarray(rng.standard_normal((6, 4)), jnp.float32), "b": [jnp.ones(6)]}
    cache = jnp.asarray(rng.standard_normal(3), jnp.float32)
    x = rng.standard_normal(4).astype(np.float32)
    t = ProgramTable(jitted, "step", "test")
    t._keep("k", jitted.lower(weights, cache, x).compile(), (weights, cache, x))
    return t, weights, cache, rng


def _counted(monkeypatch) -> list:
    """Grows by one per direct call tried."""
    used, real = [], DirectCall.__call__
    monkeypatch.setattr(DirectCall, "__call__", lambda self, a: used.append(1) or real(self, a))
    return used


def _checked_step(t, weights, cache, x):
    """One call of table `t` checked against numpy, the cache donated; returns the new cache."""
    want_y, want_sum, want_cache = _want(weights, cache, x)
    out, new_cache = t("k", (weights, cache, x), {})
    np.testing.assert_allclose(np.asarray(out["y"]), want_y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(out["sum"]), want_sum, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(new_cache), want_cache, rtol=1e-5, atol=1e-6)
    assert cache.is_deleted()  # donated, on either path
    return new_cache


def test_same_results_as_the_checked_call_with_the_cache_donated(table, monkeypatch):
    t, weights, cache, rng = table
    used = _counted(monkeypatch)
    for _ in range(4):
        cache = _checked_step(t, weights, cache, rng.standard_normal(4).astype(np.float32))
    assert isinstance(t._direct["k"], DirectCall) and len(used) == 3  # all calls but the first
    # new weights (another object): read again, not the first call's leaves
    weights = {"w": weights["w"] * 2, "b": [weights["b"][0] - 5]}
    x = rng.standard_normal(4).astype(np.float32)
    want_y, _, _ = _want(weights, cache, x)
    out, cache = t("k", (weights, cache, x), {})
    np.testing.assert_allclose(np.asarray(out["y"]), want_y, rtol=1e-5, atol=1e-6)
    assert len(used) == 4


def test_a_different_argument_takes_the_checked_call(table, monkeypatch):
    t, weights, cache, rng = table
    out, cache = t("k", (weights, cache, rng.standard_normal(4).astype(np.float32)), {})
    direct = t._direct["k"]
    for x in (
        rng.standard_normal(5).astype(np.float32),  # another shape: the jit compiles it
        rng.standard_normal(4),  # float64 (x64 off: the checked call takes it as float32)
    ):
        assert direct((weights, cache, x)) is None
        want_y, _, want_cache = _want(weights, cache, x.astype(np.float32))
        out, new = t("k", (weights, cache, x), {})
        np.testing.assert_allclose(np.asarray(out["y"]), want_y, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(new), want_cache, rtol=1e-5, atol=1e-6)
        cache = new
    assert direct(({"w": weights["w"]}, cache, np.zeros(4, np.float32))) is None  # structure
    assert direct((weights, cache)) is None
    monkeypatch.setattr(direct_call, "ENABLED", False)
    assert direct((weights, cache, np.zeros(4, np.float32))) is None


def test_programs_it_cannot_run_keep_the_checked_call():
    def noisy(x):
        jax.debug.callback(lambda v: None, x)
        return x + 1

    x = jnp.ones(3)
    assert DirectCall.of(jax.jit(noisy).lower(x).compile(), (x,)) is None
    plain = jax.jit(lambda x, n: x * n)
    assert DirectCall.of(plain.lower(x, 2.0).compile(), (x, 2.0)) is None  # a Python scalar
    assert DirectCall.of(plain.lower(x, x).compile(), (x, x)) is not None
    assert DirectCall.of(object(), (x,)) is None  # not a `Compiled` of this jax
    wide = np.ones(3)  # float64, which the checked call converts (x64 off): not moved as it is
    assert DirectCall.of(plain.lower(x, wide).compile(), (x, wide)) is None
    direct = DirectCall.of(plain.lower(x, x).compile(), (x, x))
    assert direct((x, 2.0)) is None  # a scalar where the first call had an array


def test_a_key_the_jit_ran_twice_runs_directly_after(monkeypatch):
    """No warmup (the offline `LLM`): the jit runs a key's first call; its second takes the jit's
    own executable as a `Compiled` (checked call), later ones run directly. Still counted as
    the jit's program, not as one warmup built."""
    jitted = jax.jit(_step, donate_argnums=(1,))
    t = ProgramTable(jitted, "step", "test")
    rng = np.random.default_rng(1)
    weights = {"w": jnp.asarray(rng.standard_normal((6, 4)), jnp.float32), "b": [jnp.zeros(6)]}
    cache = jnp.asarray(rng.standard_normal(3), jnp.float32)
    used = _counted(monkeypatch)
    for i in range(4):
        cache = _checked_step(t, weights, cache, rng.standard_normal(4).astype(np.float32))
        assert ("k" in t._repeats) == (i >= 1) and len(used) == max(0, i - 1)
    assert len(t) == 0 and t.jit_cache_size() == 1
    # another type under the same key: refused by the checked call, the jit's key from then on
    x = np.arange(4, dtype=np.int32)
    want_y = _want(weights, cache, x.astype(np.float32))[0]
    out, cache = t("k", (weights, cache, x), {})
    np.testing.assert_allclose(np.asarray(out["y"]), want_y, rtol=1e-5, atol=1e-6)
    assert "k" not in t._repeats and "k" in t._jit_only and t.jit_cache_size() == 2


def test_a_direct_call_shows_in_a_profile(tmp_path):
    """A trace (`jax.profiler`) still names the program's host call on the direct path."""
    import glob
    import gzip
    import json

    f = jax.jit(lambda a, b: a * 2 + b)
    t = ProgramTable(f, "step", "test")
    x = jnp.ones(4)
    t._keep("k", f.lower(x, x).compile(), (x, x))
    t("k", (x, x), {})
    assert isinstance(t._direct["k"], DirectCall)
    with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
        t("k", (x, x), {}).block_until_ready()
    (path,) = glob.glob(str(tmp_path / "**" / "*.trace.json.gz"), recursive=True)
    with gzip.open(path) as fh:
        names = {e.get("name") for e in json.load(fh)["traceEvents"]}
    assert "direct jit(<lambda>)" in names
