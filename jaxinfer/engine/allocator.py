"""The engine-core process's memory allocator: jemalloc where the machine has it.

On XLA:CPU the engine thread's first glibc allocation after each step costs it ~0.1-0.15 ms of
CPU (BENCHMARKS.md "The engine thread's first allocation after a step"); with jemalloc preloaded
the engine thread spent 0.42 ms less CPU a decode token of the default model (10 alternated
pairs, every one lower) and decoded 1.11x as fast (paired median). vLLM recommends preloading
tcmalloc for its CPU backend for the same reason. Imports no JAX (the front end uses it).

`core_env()` is what the spawned engine-core process gets added to its environment:
`LD_PRELOAD` with jemalloc first (the dynamic linker resolves the bare name on its library path)
when `ctypes.util.find_library("jemalloc")` finds it (Debian / Ubuntu: `apt install
libjemalloc2`), unless `JAXINFER_MALLOC=system`, or `LD_PRELOAD` already names jemalloc or
tcmalloc. `JAXINFER_MALLOC=/path/to/lib.so` preloads that file instead. An offline `LLM` runs
in the caller's process: preload there yourself (`LD_PRELOAD=libjemalloc.so.2 python ...`).
"""

from __future__ import annotations

import ctypes.util
import os

ENV = "JAXINFER_MALLOC"  # "auto" (default), "system", or a shared library's path


def jemalloc() -> str | None:
    """jemalloc's library name on this machine, or None."""
    return ctypes.util.find_library("jemalloc")


def core_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables to add to the engine-core process's environment (see the module
    docstring); empty: the system allocator. Raises ValueError for a `JAXINFER_MALLOC` path
    that does not exist (named)."""
    environ = os.environ if environ is None else environ
    choice = environ.get(ENV, "auto")
    current = environ.get("LD_PRELOAD", "")
    if choice == "system" or "jemalloc" in current or "tcmalloc" in current:
        return {}
    if choice == "auto":
        lib = jemalloc()
        if lib is None:
            return {}
    elif os.path.isfile(choice):
        lib = choice
    else:
        raise ValueError(f"{ENV}={choice!r}: 'auto', 'system' or an existing library file")
    return {"LD_PRELOAD": f"{lib} {current}".strip()}


__all__ = ["ENV", "core_env", "jemalloc"]
