"""Serialized executables under our own key: a warm restart loads its programs without tracing.

JAX's persistent compilation cache (`jaxinfer.compile_cache`) keys an entry by the lowered
program, so a restart must still trace and lower every program to find it (most of a warm
restart: BENCHMARKS.md "Restarts"). This cache keys a program by what it is built from instead,
and stores the compiled executable (`jax.experimental.serialize_executable`), so a restart that
finds it traces nothing.

1. `ExecutableCache.open()` is the cache of this process: `executables/` under the compilation
   cache directory (`compile_cache.active_dir()`), None while that cache is off.
2. `program_key(name, args, statics, context)` describes one program: its name and its build
   `context` (the jit's own options: backends, mesh, donation, compiler options...), the static
   arguments' reprs, the tree structure and every argument leaf's shape, dtype, weak type and
   sharding; `environment()` (once per process) adds the jax/jaxlib versions, the backend, its
   devices and process count, this CPU's instruction set, XLA_FLAGS and the JAX/XLA/LIBTPU/
   JAXINFER environment, JAX's trace context and `source_hash()` (the .py/.cc files of
   `jaxinfer/` and `pallas_kernels/`: any change of the code that builds programs misses).
3. `load(key)` returns the loaded `jax.stages.Compiled` (None: not there, or unusable: a corrupt
   or unloadable entry is logged once and the caller compiles); `store(key, compiled)` writes
   the entry atomically (a temporary file, then `os.replace`); `counts()` says how many
   programs this process loaded and stored.

4. `first_use_cache()`: the cache for the programs a runner compiles on first use (not by
   warmup), once `cache_first_use()` turned that on for this process (the served engine core
   does: `serving.launch.build_core`); None otherwise (JAX's persistent cache alone).

NOTE: an entry holds the whole key text and is used only when it equals the caller's, so a hash
collision cannot load a wrong program; the loaded `Compiled` also checks every argument's type
at each call (a mismatch raises before anything runs). Donation and shardings are part of the
executable and survive the round trip.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import platform
import re
import tempfile
import threading
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import serialize_executable

from jaxinfer import compile_cache
from pallas_kernels import cpu_build

logger = logging.getLogger(__name__)

FORMAT = 1  # bump when the entry layout changes
SUBDIR = "executables"
SOURCE_ROOTS = ("jaxinfer", "pallas_kernels")
_ENV_PREFIXES = ("JAX_", "XLA_", "LIBTPU", "JAXINFER_", "TPU_", "CUDA_VISIBLE_DEVICES")
_ENV_IGNORED = ("JAX_COMPILATION_CACHE_DIR", "JAXINFER_KERNEL_CACHE")
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")  # an object's repr without its address
_counts = {"loaded": 0, "stored": 0}
_first_use = False
_lock = threading.Lock()


@functools.cache
def source_hash() -> str:
    """sha256 over the path and bytes of every .py / .cc / .h file under `jaxinfer/` and
    `pallas_kernels/` (computed once per process: ~1 MB of reads)."""
    return hash_sources(Path(__file__).resolve().parent.parent)


def hash_sources(root: Path) -> str:
    """`source_hash` of the package tree under `root`."""
    digest = hashlib.sha256()
    for top in SOURCE_ROOTS:
        for path in sorted((root / top).rglob("*")):
            if path.suffix in (".py", ".cc", ".h") and path.is_file():
                digest.update(str(path.relative_to(root)).encode() + b"\0")
                digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.cache
def environment() -> str:
    """What every program of this process is compiled under (see the module docstring)."""
    import jaxlib
    from jax._src import config as jax_config

    backend = jax.devices()[0].client
    env = sorted(
        (k, v)
        for k, v in os.environ.items()
        if k.startswith(_ENV_PREFIXES) and k not in _ENV_IGNORED
    )
    parts = [
        f"format={FORMAT}",
        f"jax={jax.__version__} jaxlib={jaxlib.__version__}",
        f"backend={backend.platform} {backend.platform_version}",
        f"devices={[(d.id, d.device_kind, d.process_index) for d in jax.devices()]}",
        f"processes={jax.process_count()} index={jax.process_index()}",
        f"cpu={platform.machine()} {cpu_build.cpu_flags()}",
        f"env={env}",
        f"trace_context={_ADDRESS.sub('', repr(jax_config.trace_context()))}",
        f"source={source_hash()}",
    ]
    return "\n".join(parts)


def _leaf(x: Any) -> str:
    if isinstance(x, jax.Array | jax.ShapeDtypeStruct):
        sharding = getattr(x, "sharding", None)
        weak = getattr(x, "weak_type", False)
        return f"{x.dtype}{list(x.shape)} weak={weak} {sharding!r}"
    if isinstance(x, np.ndarray | np.generic):
        return f"{x.dtype}{list(x.shape)} host"
    return f"{type(x).__name__}:{x!r}"


def program_key(name: str, args: tuple, statics: dict[str, Any], context: str) -> str:
    """The key text of program `name` called with dynamic `args` and `statics` (see the module
    docstring); `context` names what the jit was built with beyond its arguments."""
    leaves, treedef = jax.tree.flatten(args)
    return "\n".join(
        [
            f"program={name}",
            f"context={context}",
            *(f"static {k}={statics[k]!r}" for k in sorted(statics)),
            f"tree={treedef}",
            *map(_leaf, leaves),
            environment(),
        ]
    )


class ExecutableCache:
    """The serialized executables of one directory (see the module docstring)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._warned = False

    @classmethod
    def open(cls) -> ExecutableCache | None:
        """The cache under the active compilation cache directory (None while that is off)."""
        base = compile_cache.active_dir()
        return cls(os.path.join(base, SUBDIR)) if base else None

    def _file(self, key: str) -> str:
        return os.path.join(self.path, hashlib.sha256(key.encode()).hexdigest() + ".jexe")

    def holds(self, key: str) -> bool:
        """Whether an entry for `key` exists (`load` may still find it unusable)."""
        return os.path.exists(self._file(key))

    def load(self, key: str) -> Any:
        """The loaded `Compiled` stored under `key`, or None (missing or unusable: logged once)."""
        file = self._file(key)
        try:
            with open(file, "rb") as f:
                blob = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            self._unusable(file, e)
            return None
        try:
            stored_key, device_ids, payload, in_tree, out_tree = pickle.loads(blob)
            if stored_key != key:
                return None
            by_id = {d.id: d for d in jax.devices()}
            devices = [by_id[i] for i in device_ids]
            compiled = serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, backend=devices[0].client, execution_devices=devices
            )
        except Exception as e:  # noqa: BLE001 - any unreadable entry: compile instead
            self._unusable(file, e)
            return None
        _count("loaded")
        compile_cache.count_executable()
        return compiled

    def store(self, key: str, compiled: Any) -> bool:
        """Writes `compiled` under `key` atomically; False (logged once) where it cannot."""
        try:
            payload, in_tree, out_tree = serialize_executable.serialize(compiled)
            unloaded = compiled._executable._unloaded_executable  # NOTE: its device order
            device_ids = [d.id for d in unloaded.device_list]
            blob = pickle.dumps((key, device_ids, payload, in_tree, out_tree), protocol=5)
            os.makedirs(self.path, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(blob)
                os.replace(tmp, self._file(key))
            except BaseException:
                os.unlink(tmp)
                raise
        except Exception as e:  # noqa: BLE001 - a program that cannot be stored is compiled again
            self._unusable(self.path, e, storing=True)
            return False
        _count("stored")
        return True

    def _unusable(self, where: str, e: BaseException, storing: bool = False) -> None:
        with _lock:
            if self._warned:
                return
            self._warned = True
        what = "cannot store in %s (%s: %s): the next start compiles it again"
        if not storing:
            what = "unusable entry %s (%s: %s): compiling it instead"
        logger.warning("executable cache: " + what, where, type(e).__name__, e)


def cache_first_use(on: bool = True) -> None:
    """Programs compiled on first use go through the executable cache in this process."""
    global _first_use
    _first_use = on


def first_use_cache() -> ExecutableCache | None:
    """The cache for programs compiled on first use (see the module docstring, step 4)."""
    return ExecutableCache.open() if _first_use else None


def _count(name: str) -> None:
    with _lock:
        _counts[name] += 1


def counts() -> dict[str, int]:
    """Executables this process loaded from the cache and stored in it so far."""
    with _lock:
        return dict(_counts)


__all__ = [
    "ExecutableCache",
    "cache_first_use",
    "counts",
    "environment",
    "first_use_cache",
    "program_key",
    "source_hash",
]
