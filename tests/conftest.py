"""Test-wide setup that must happen before JAX is imported.

1. Multi-device tests run on 8 virtual CPU devices (ARCHITECTURE.md §4.3). XLA reads the flag
   once, when the CPU backend starts, so it is set here, before any test module imports JAX.
   Single-device code keeps using the first device.
2. JAX's persistent compilation cache is on, in `.pytest_cache/xla` at the repository root
   (shared by pytest-xdist workers and by the engine/server processes tests spawn, which inherit
   the environment). Most tests build their own engine over the same tiny models, so most step
   programs are identical HLO compiled again: the cache turns those recompiles into a file read
   (tests/test_engine.py alone: 113 s -> 28 s from an empty cache). It changes no program: the
   key is the HLO, the compile options and the jax/XLA version. `JAX_COMPILATION_CACHE_DIR` set
   by the caller wins (an empty value turns the cache off).
3. The heaviest files (per-file sums of `pytest --durations` on the 2-core machine) are
   collected first, so `-n 2 --dist loadfile` hands them out first and the two workers finish
   together (longest first), instead of one worker starting test_spec_decode near the end while
   the other idles. Every other file keeps its order; no test is skipped or changed.
4. XLA compiles the tests' programs with little optimization (`JAX_DISABLE_MOST_OPTIMIZATIONS`:
   LLVM at -O0, no expensive passes). The suite spends most of its time compiling tiny models'
   step programs that then run a few steps, so compiling them well costs more than it saves
   (two heavy tests from an empty cache: 41 s -> 24 s; the whole suite's CPU time on 2 cores:
   63 -> 47 min, loaded). HLO semantics are unchanged: every
   numeric comparison runs both sides under the same setting. A caller's value wins
   (`JAX_DISABLE_MOST_OPTIMIZATIONS=0` compiles as users' processes do).
5. XLA:CPU emits its fusions with the LLVM IR emitters instead of the newer MLIR fusion emitters
   (`--xla_cpu_use_fusion_emitters=false`, jaxlib 0.10 only: an unknown XLA flag is fatal). The
   newer path runs an MLIR pipeline per fusion and compiled the tiny models' programs 2-3x slower
   (a 2-layer Llama forward: 1.3-1.7 s -> 0.6 s of CPU; whole tests 40-70% less CPU). Same HLO,
   same fusion decisions; every numeric comparison runs both sides under this setting.
6. JAX runs on the CPU (`JAX_PLATFORMS=cpu`, unless the caller sets it). The test venv may hold
   the CUDA plugin and libtpu for the deviceless accelerator compiles; without this, libtpu would
   probe for a TPU in every test process and spawned server, and the CUDA plugin would look for
   a driver. Deviceless compiles need the CPU platform set this way in any case, and the two
   workers may both load libtpu for them (`ALLOW_MULTIPLE_LIBTPU_LOAD`: no fight over its lock).
7. Opt-in CPU report (`JAXINFER_TEST_CPU=PATH`): each pytest process appends to PATH one line per
   test file, `file<TAB>CPU s<TAB>wall s<TAB>tests<TAB>mappings`, user + sys of the process and
   its reaped children (served processes, multihost workers) from the file's first test's setup
   to its last test's teardown, and the process's memory mappings at its end (item 9), and a
   `(startup + collection)` line: where a whole run's CPU goes.
8. `serving.launch.build_core` turns on first-use executable caching for its process (the served
   engine core's setting, `executable_cache.cache_first_use`); the tests that call it in-process
   get it turned back off after them (`_first_use_restored`), so a later in-process engine in the
   same worker shares its programs through JAX's caches as users' processes do (with it left on,
   a program JAX's persistent cache answered was not stored, and the next engine traced it again:
   test_engine's second-engine test failed whenever such a test ran before it in its worker).
9. A pytest worker's memory mappings are kept well below `vm.max_map_count` (Linux's default
   65,530 a process). Every program XLA:CPU compiles and loads maps about three regions of JIT
   code and data per compiled function, and JAX's caches keep those programs alive, so a worker
   that runs half of the suite accumulates them: on the 2-vCPU Sapphire Rapids VM a worker reached
   the limit (65,530 mappings in its core dump) at ~87% of a whole run, and the next compile or
   executable serialization died (SIGSEGV, or SIGABRT) in `test_warmup_leaves_nothing_to_compile`
   (BENCHMARKS.md "int4 on AVX-512 VNNI"). After a test file whose end finds the worker above a
   quarter of the limit, `jax.clear_caches()` and a garbage collection release the programs no
   live object holds (two files: 3,090 mappings -> 721); later files reload from JAX's persistent
   cache. A quarter: one file alone added 24,400 mappings in a whole run (test_quantization.py),
   so a file that starts just below the threshold still ends far from the limit.
"""

import importlib.metadata
import os
import pathlib
import resource
import sys
import time

import pytest


def _add_xla_flag(flag: str) -> None:
    """Appends `flag` to XLA_FLAGS unless the caller set that flag already."""
    if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


_add_xla_flag("--xla_force_host_platform_device_count=8")
if importlib.metadata.version("jaxlib").startswith("0.10."):
    _add_xla_flag("--xla_cpu_use_fusion_emitters=false")

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _CACHE = pathlib.Path(__file__).resolve().parent.parent / ".pytest_cache" / "xla"
    _CACHE.mkdir(parents=True, exist_ok=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(_CACHE)
if os.environ["JAX_COMPILATION_CACHE_DIR"]:
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

HEAVY_FIRST = (  # NOTE: re-ranked 2026-11-26 after the day's cuts (per-file CPU, heaviest first)
    "test_kernels.py",
    "test_quantization.py",
    "test_pipeline.py",
    "test_spec_decode.py",
    "test_multihost.py",
    "test_moe.py",
    "test_real_model.py",
    "test_deepseek.py",
    "test_parallel.py",
    "test_served_requests.py",
    "test_accel_kernels.py",
    "test_aot.py",
    "test_structured_output.py",
    "test_runner.py",
    "test_consistency.py",
    "test_engine.py",
    "test_model_parity.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: in-file order kept


def _cpu_seconds() -> float:
    own, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


_CPU_REPORT: dict[str, list[float]] = {}  # file -> [CPU s, wall s, tests, mappings at its end]


def pytest_collection_finish(session):
    if os.environ.get("JAXINFER_TEST_CPU"):
        _CPU_REPORT["(startup + collection)"] = [_cpu_seconds(), 0.0, 0, _memory_maps()]


def _memory_maps() -> int:
    """This process's memory mappings (0 where /proc is missing)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0


def _maps_threshold() -> int:
    """A quarter of the kernel's per-process mapping limit (item 9)."""
    try:
        return int(pathlib.Path("/proc/sys/vm/max_map_count").read_text()) // 4
    except (OSError, ValueError):
        return 65530 // 4


_MAPS_THRESHOLD = _maps_threshold()


def _release_programs_if_many_maps() -> int:
    """Item 9: the worker's mappings after releasing unreferenced programs when above the
    threshold."""
    maps = _memory_maps()
    if maps > _MAPS_THRESHOLD and "jax" in sys.modules:
        import gc

        sys.modules["jax"].clear_caches()
        gc.collect()
        maps = _memory_maps()
    return maps


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    report = bool(os.environ.get("JAXINFER_TEST_CPU"))
    cpu, wall = (_cpu_seconds(), time.perf_counter()) if report else (0.0, 0.0)
    yield
    last_of_file = nextitem is None or nextitem.path != item.path
    maps = _release_programs_if_many_maps() if last_of_file else 0
    if not report:
        return
    row = _CPU_REPORT.setdefault(item.path.name, [0.0, 0.0, 0, 0])
    row[0] += _cpu_seconds() - cpu
    row[1] += time.perf_counter() - wall
    row[2] += 1
    row[3] = maps or row[3]


def pytest_sessionfinish(session):
    path = os.environ.get("JAXINFER_TEST_CPU")
    if path and _CPU_REPORT:
        with open(path, "a") as f:
            for name, (cpu, wall, n, maps) in _CPU_REPORT.items():
                f.write(f"{name}\t{cpu:.1f}\t{wall:.1f}\t{n}\t{maps}\n")


@pytest.fixture(autouse=True)
def _first_use_restored():
    """Item 8 of the module docstring."""
    from jaxinfer import executable_cache

    was = executable_cache._first_use
    yield
    executable_cache._first_use = was
