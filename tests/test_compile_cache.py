"""The persistent compilation cache through the real `scripts/serve.py` (jaxinfer/compile_cache.py).

1. A cold start into an empty `--compilation-cache-dir` compiles every program (none from the
   cache) and writes them there; a restart with the same flags reads every one of them back.
2. Another KV-cache shape (`--num-pages`) changes every step program's HLO, so it shares none of
   them: the cache key is the program, never a wrong one reused.
3. (`--no-compilation-cache` is served by tests/test_served_profile.py's fake server, to share it.)
4. The default KV-cache size (read from free memory) is rounded down, so restarts on a machine
   whose free memory moved a little size it alike (the page count is in every program).
5. Which directory: an explicit one, else `JAX_COMPILATION_CACHE_DIR`, else the per-user default;
   an empty one is off.
"""

import re

import pytest
from served_utils import ServedProcess, tiny_model_dir

SUMMARY = re.compile(
    r"(\d+) programs, (?:(\d+) from the compilation cache ([^\s;]+)|compilation cache off)"
)


def start(model, *flags: str) -> tuple[int, int | None, str | None]:
    """Starts the tiny model with warmup (every program compiled), stops it; returns (programs,
    from the cache or None when off, the cache dir)."""
    sizes = ["--max-model-len", "32", "--max-num-seqs", "2", "--max-num-batched-tokens", "8"]
    served = ServedProcess(["--model", str(model), "--load-format", "dummy", *sizes, *flags])
    try:
        m = SUMMARY.search("".join(served.log))
    finally:
        assert served.stop() == 0
    assert m, "".join(served.log[-20:])
    return int(m.group(1)), None if m.group(2) is None else int(m.group(2)), m.group(3)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny"))


def test_restart_reads_every_program_and_another_shape_none(model, tmp_path):
    cache = str(tmp_path / "xla")
    programs, hits, where = start(model, "--compilation-cache-dir", cache, "--num-pages", "32")
    assert programs > 0 and hits == 0 and where == cache
    assert start(model, "--compilation-cache-dir", cache, "--num-pages", "32") == (
        programs,
        programs,
        cache,
    )
    step_programs = len(list((tmp_path / "xla").glob("jit_packed_step_program-*-cache")))
    assert step_programs > 0
    # NOTE: only the few programs that never see the KV cache (they hold no pages) may be shared;
    # every step program is new.
    other, shared, _ = start(model, "--compilation-cache-dir", cache, "--num-pages", "24")
    assert other == programs and shared < programs
    after = len(list((tmp_path / "xla").glob("jit_packed_step_program-*-cache")))
    assert after == 2 * step_programs


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
