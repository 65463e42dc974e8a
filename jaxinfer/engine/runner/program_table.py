"""The programs warmup built, called as the `Compiled` executables themselves.

1. `ProgramTable(jitted, name, context)` wraps one jitted function (the step or the sampler).
2. `build(key, args, kwargs, cache, pool, jobs)` (warmup) makes the program of one call
   signature: loaded from the executable cache (`jaxinfer.executable_cache`: nothing traced),
   else lowered here and compiled on `pool` (then stored in the cache); it is kept under `key`,
   the call's signature as the runner describes it (its static arguments on one device).
3. `table(key, args, kwargs)` runs the program kept under `key` on the call's dynamic
   arguments, or the jitted function (which traces and compiles a shape warmup did not build,
   also where an argument the key does not describe differs from warmup's).

NOTE: a `Compiled` checks every argument's type before it runs (a mismatch raises TypeError,
nothing donated), so a key that describes a call incompletely cannot run a wrong program.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from jaxinfer.executable_cache import ExecutableCache, program_key


class ProgramTable:
    """The compiled programs of one jitted function, by call key (see the module docstring)."""

    def __init__(self, jitted: Any, name: str, context: str, static_argnums: tuple = ()) -> None:
        self.jitted, self.name, self.context = jitted, name, context
        self.static_argnums = static_argnums  # positional arguments the jit treats as static
        self.programs: dict[Any, Any] = {}

    def __len__(self) -> int:
        return len(self.programs)

    def __contains__(self, key: Any) -> bool:
        return key in self.programs

    def dynamic(self, args: tuple) -> tuple:
        """`args` without the static ones (what a `Compiled` takes)."""
        return tuple(a for i, a in enumerate(args) if i not in self.static_argnums)

    def __call__(self, key: Any, args: tuple, kwargs: dict) -> Any:
        program = self.programs.get(key)
        if program is not None:
            try:
                return program(*self.dynamic(args))
            except TypeError:  # NOTE: raised by the argument check, before anything ran
                pass  # e.g. a wider suppress-ids table than warmup's: the jit builds that one
        return self.jitted(*args, **kwargs)

    def disk_key(self, args: tuple, kwargs: dict) -> str:
        """This call's key in the executable cache (`executable_cache.program_key`)."""
        statics = {**kwargs, **{f"arg{i}": args[i] for i in self.static_argnums}}
        return program_key(self.name, self.dynamic(args), statics, self.context)

    def jit_cache_size(self) -> int:
        return self.jitted._cache_size()

    def build(
        self,
        key: Any,
        args: tuple,
        kwargs: dict,
        cache: ExecutableCache | None,
        pool: ThreadPoolExecutor,
        jobs: list[Future],
    ) -> Any:
        """Makes the program of this call (see the module docstring); returns its `Compiled`
        (loaded) or `Lowered` (compiling on `pool`, its future appended to `jobs`): both give
        `out_info`."""
        disk_key = None
        if cache is not None:
            disk_key = self.disk_key(args, kwargs)
            program = cache.load(disk_key)
            if program is not None:
                self.programs[key] = program
                return program
        lowered = self.jitted.lower(*args, **kwargs)
        jobs.append(pool.submit(self._compile, key, lowered, cache, disk_key))
        return lowered

    def _compile(
        self, key: Any, lowered: Any, cache: ExecutableCache | None, disk_key: str | None
    ) -> None:
        compiled = lowered.compile()
        if cache is not None:
            cache.store(disk_key, compiled)
        self.programs[key] = compiled


__all__ = ["ProgramTable"]
