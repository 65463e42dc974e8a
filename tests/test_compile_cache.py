"""The persistent compilation cache (jaxinfer/compile_cache.py).

1. One served pair over the tiny model, warmup on, the smallest budgets (a few programs): a cold
   start into an empty `--compilation-cache-dir` reads no program from the cache and writes them
   there (as executables, `executables/`); a restart with the same flags loads every one of
   them back without tracing (tests/test_executable_cache.py: the same in process).
2. In process, the keying: JAX keys an entry by the program's HLO, so a program is reused only
   where the HLO is the same. The step program lowered twice for one configuration is the same
   (what lets a restart read it); another page count, page size, token bucket, logits variant or
   attention backend lowers to another one (never a wrong program reused).
3. (`--no-compilation-cache` is served by tests/test_served_profile.py's fake server, to share it.)
4. The default KV-cache size (read from free memory) is rounded down, so restarts on a machine
   whose free memory moved a little size it alike (the page count is in every program).
5. Which directory: an explicit one, else `JAX_COMPILATION_CACHE_DIR`, else the per-user default;
   an empty one is off.
"""

import re

import jax
import pytest
from served_utils import ServedProcess, tiny_model_dir

from jaxinfer.config import ModelConfig
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.models import llama
from jaxinfer.params import init_random

SUMMARY = re.compile(
    r"(\d+) programs, (?:(\d+) from the compilation cache ([^\s;]+) \((\d+) loaded as executables\)"
    r"|compilation cache off)"
)


def start(model, *flags: str) -> tuple[int, int | None, str | None, int | None]:
    """Starts the tiny model with warmup (every program compiled), stops it; returns (programs,
    from the cache or None when off, the cache dir, of those loaded as executables)."""
    # NOTE: a 1-token budget: one token bucket, so warmup builds the 2 logits variants only
    sizes = ["--max-model-len", "16", "--max-num-seqs", "1", "--max-num-batched-tokens", "1"]
    served = ServedProcess(["--model", str(model), "--load-format", "dummy", *sizes, *flags])
    try:
        m = SUMMARY.search("".join(served.log))
    finally:
        assert served.stop() == 0
    assert m, "".join(served.log[-20:])
    cached, loaded = (None, None) if m.group(2) is None else (int(m.group(2)), int(m.group(4)))
    return int(m.group(1)), cached, m.group(3), loaded


def test_restart_reads_every_program(tmp_path):
    model = tiny_model_dir(tmp_path / "tiny")
    cache = str(tmp_path / "xla")
    programs, hits, where, loaded = start(
        model, "--compilation-cache-dir", cache, "--num-pages", "8"
    )
    assert programs > 0 and hits == loaded == 0 and where == cache
    assert len(list((tmp_path / "xla" / "executables").glob("*.jexe"))) == programs
    again = start(model, "--compilation-cache-dir", cache, "--num-pages", "8")
    assert again == (programs, programs, cache, programs)  # nothing traced


TINY = dict(
    model_type="llama",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    vocab_size=128,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig.from_hf(TINY)
    return cfg, init_random(llama.param_specs(cfg), jax.random.key(0))


def step_hlo(tiny, t_bucket: int = 4, all_logits: bool = False, **over) -> str:
    """The step program's HLO text for a runner over `tiny` with `over` changed."""
    cfg, params = tiny
    kw = dict(page_size=8, num_pages=16, max_model_len=32, max_num_seqs=2)
    kw |= over
    runner = ModelRunner(cfg, params, max_num_batched_tokens=8, token_buckets=(4, 8), **kw)
    return runner.lower(t_bucket, all_logits).as_text()


def test_another_shape_or_option_is_another_program(tiny):
    base = step_hlo(tiny)
    jax.clear_caches()  # NOTE: traced and lowered afresh, as in a restart (runners share traces)
    assert step_hlo(tiny) == base  # one configuration, one program: a restart reads it back
    others = [
        step_hlo(tiny, num_pages=24),
        step_hlo(tiny, page_size=16),
        step_hlo(tiny, t_bucket=8),
        step_hlo(tiny, all_logits=True),
        step_hlo(tiny, attention_backend="reference"),
    ]
    assert len({base, *others}) == len(others) + 1


def test_which_directory(monkeypatch, tmp_path):
    from jaxinfer import compile_cache

    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
    assert compile_cache.resolve_dir(str(tmp_path / "flag")) == str(tmp_path / "flag")
    assert compile_cache.resolve_dir("") == ""
    assert compile_cache.resolve_dir() == str(tmp_path / "env")
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.resolve_dir() == str(tmp_path / "xdg" / "jaxinfer" / "xla")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.resolve_dir() == str(tmp_path / "home" / ".cache" / "jaxinfer" / "xla")


def test_default_kv_cache_size_is_stable():
    from jaxinfer.compile_cache import stable_bytes

    gib = 1 << 30
    assert stable_bytes(int(3.45 * gib)) == stable_bytes(int(3.05 * gib)) == 2 * gib
    assert stable_bytes(4 * gib) == 4 * gib
    assert stable_bytes(int(37.6 * gib), step=gib) == stable_bytes(int(37.1 * gib), step=gib)
    assert stable_bytes(int(0.5 * gib), step=gib) == int(0.5 * gib)  # never below one step
