"""The persistent XLA compilation cache: a restart reads its compiled programs from disk.

1. `resolve_dir(requested)` picks the directory: an explicit one (`serve.py
   --compilation-cache-dir DIR`, `LLM(compilation_cache_dir=DIR)`; `""` or
   `--no-compilation-cache`: off) wins, then `JAX_COMPILATION_CACHE_DIR` from the environment
   (an empty value: off; tests/conftest.py sets it for the suite), then the per-user default
   `$XDG_CACHE_HOME/jaxinfer/xla` (`~/.cache/jaxinfer/xla`).
2. `enable(requested)` points JAX at it before the process compiles anything (the engine-core
   process calls it first thing in `serving.launch.build_core`; `LLM` in its constructor) and
   caches every program, however fast it compiled (JAX's default skips programs under 1 s; a
   `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS` from the environment wins).
3. `persistent_cache_paused()` turns it off for a block (the runner's warmup compiles the
   programs it stores as executables under it: `jaxinfer.executable_cache`).
4. `cache_counts()` counts JAX's own events (`jax.monitoring`: `/jax/compilation_cache/
   cache_hits`, `cache_misses`, `compile_requests_use_cache`) since the process started, and
   the programs loaded from the executable cache (`count_executable`); the engine reports both
   for its warmup in the start-up summary.

NOTE: JAX keys each entry by a hash of the serialized HLO module (every shape, dtype, sharding
and constant of the program), the compile options, the backend and device kind, the XLA flags
and the jax/jaxlib versions. Another model shape or engine option (page size, buckets, dtype,
quantization, attention backend, mesh) lowers to another HLO and therefore another key: a
program is never reused for a configuration it was not compiled for
(tests/test_compile_cache.py checks that two configurations do not share).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")

EVENTS = {
    "/jax/compilation_cache/cache_hits": "hits",
    "/jax/compilation_cache/cache_misses": "misses",
    "/jax/compilation_cache/compile_requests_use_cache": "requests",
}

_counts = {name: 0 for name in EVENTS.values()} | {"executables": 0}
_lock = threading.Lock()
_listening = False


def default_dir() -> str:
    """The per-user cache directory: `$XDG_CACHE_HOME/jaxinfer/xla`, else `~/.cache/jaxinfer/xla`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxinfer", "xla")


def resolve_dir(requested: str | None = None) -> str:
    """The cache directory to use ("" means off): `requested` if given, else the environment's
    `JAX_COMPILATION_CACHE_DIR`, else `default_dir()`."""
    if requested is not None:
        return os.path.expanduser(requested)
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    return default_dir()


def enable(requested: str | None = None) -> str:
    """Turns the persistent cache on in `resolve_dir(requested)` (or off where that is "") for
    this process; returns the directory ("" when off). Call it before the first compile; a later
    call with another directory starts a fresh cache there."""
    import jax

    path = resolve_dir(requested)
    _listen()
    current = jax.config.jax_compilation_cache_dir or ""
    if path == current and jax.config.jax_enable_compilation_cache == bool(path):
        return path
    if path:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            logger.warning("compilation cache off: cannot create %s (%s)", path, e)
            path = ""
    if current:
        from jax.experimental.compilation_cache import compilation_cache

        compilation_cache.reset_cache()  # NOTE: JAX opened the old directory already
    jax.config.update("jax_compilation_cache_dir", path or None)
    jax.config.update("jax_enable_compilation_cache", bool(path))
    if path and "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    logger.info("XLA compilation cache: %s", path or "off")
    return path


@contextlib.contextmanager
def persistent_cache_paused() -> Iterator[None]:
    """JAX's persistent cache off (process-wide) while the block runs, then on again as it was.

    NOTE: the runner's warmup compiles the programs it stores in its executable cache
    (`jaxinfer.executable_cache`) under this: on XLA:CPU (jaxlib 0.10.2) an executable JAX read
    from its persistent cache serializes to bytes whose functions are missing once loaded again
    ("Function region_0.1 not found" when run), so only freshly compiled ones may be stored.
    """
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    if not jax.config.jax_enable_compilation_cache:
        yield
        return
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # NOTE: JAX decides once whether the cache is used
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        compilation_cache.reset_cache()


def compiled_fresh(compile_fn: Callable[[], T]) -> tuple[T, bool]:
    """`compile_fn()` and whether XLA compiled it (no hit in JAX's persistent cache meanwhile, in
    any thread): only such an executable may be serialized (see `persistent_cache_paused`)."""
    _listen()
    hits = cache_counts()["hits"]
    out = compile_fn()
    return out, cache_counts()["hits"] == hits


def active_dir() -> str:
    """The directory JAX caches into in this process ("": off, or JAX not loaded)."""
    jax = sys.modules.get("jax")
    if jax is None or not jax.config.jax_enable_compilation_cache:
        return ""
    return jax.config.jax_compilation_cache_dir or ""


def stable_bytes(n: int, step: int | None = None) -> int:
    """`n` rounded down to a multiple of `step` (None: to a power of two), never below one step.

    NOTE: a size read from the free memory (the default KV cache) moves a little between runs;
    the page count is in every step program's shapes, so an exact size would key every restart's
    programs afresh. Rounded down, restarts on the same machine compile the same programs.
    """
    if n <= 0:
        return n
    if step is None:
        return 1 << (n.bit_length() - 1)
    return n - n % step if n >= step else n


def cache_counts() -> dict[str, int]:
    """JAX's compilation-cache events in this process so far (hits, misses, requests) and the
    programs loaded from the executable cache (executables: `count_executable`)."""
    with _lock:
        return dict(_counts)


def count_executable() -> None:
    """One more program loaded from the executable cache (`jaxinfer.executable_cache`)."""
    with _lock:
        _counts["executables"] += 1


def _listen() -> None:
    global _listening
    with _lock:
        if _listening:
            return
        _listening = True
    import jax

    def on_event(event: str, **_: object) -> None:
        name = EVENTS.get(event)
        if name is not None:
            with _lock:
                _counts[name] += 1

    jax.monitoring.register_event_listener(on_event)


__all__ = [
    "active_dir",
    "cache_counts",
    "compiled_fresh",
    "count_executable",
    "default_dir",
    "enable",
    "persistent_cache_paused",
    "resolve_dir",
    "stable_bytes",
]
