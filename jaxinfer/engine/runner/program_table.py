"""The programs warmup built, called as the `Compiled` executables themselves.

1. `ProgramTable(jitted, name, context, fresh=...)` wraps one jitted function (the step or the
   sampler); `fresh()` makes the same jitted function over a function object of its own.
2. `build(key, args, kwargs, cache, pool)` (warmup) makes the program of one call signature:
   loaded from the executable cache on `pool` (`jaxinfer.executable_cache`: nothing traced;
   XLA loads without the GIL, so loads overlap), else lowered here and compiled on `pool` (then
   stored in the cache); it is kept under `key`, the call's signature as the runner describes
   it (its static arguments on one device). NOTE: a program to store is lowered and compiled by
   the `fresh()` jit: the shared one may hand back, from JAX's in-memory caches, an executable
   read from JAX's persistent cache, which does not serialize whole on XLA:CPU
   (`compile_cache.persistent_cache_paused`).
3. `table(key, args, kwargs)` runs the program kept under `key` on the call's dynamic
   arguments, or the jitted function (which traces and compiles a shape warmup did not build,
   also where an argument the key does not describe differs from warmup's). After a program's
   first (checked) call, calls of the same argument shapes run it through its loaded
   executable (`direct_call.DirectCall`: ~0.3-0.6 ms less host time a decode step); so do the
   keys the jit ran more than once (their `Compiled` taken from the jit's caches, `_repeated`).
4. `jit_cache_size()` counts the programs this table's calls took from the jitted function: one
   per call signature (the key, and the type, shape, dtype and sharding of every argument after
   the `fixed` leading ones). NOTE: not the jit's own `_cache_size()`: runners with the same
   options share one function object, so JAX's caches behind their jits are shared too
   (`programs.bound`); a runner's count must not include another runner's programs.
5. With `first_use` set (the served engine core: `executable_cache.first_use_cache()`), a call
   warmup did not build makes its program as `build` does, synchronously: loaded from the
   executable cache, else lowered and compiled here and stored (unless JAX read it from its
   persistent cache: such executables do not survive serialization, see `compile_cache`). So a
   second process with `--no-warmup` traces nothing a first one compiled.

NOTE: a `Compiled` checks every argument's type before it runs (a mismatch raises TypeError,
nothing donated), so a key that describes a call incompletely cannot run a wrong program. It
checks their layouts too, and would refuse int4 weights' codes (4-bit arrays report their
layouts without the sub-byte size XLA compiled for): each program is told of that quirk when
it is kept (`_keep`), before its first call, so int4 runners run warmup's programs like any
other (they had fallen back to the jit: a compile on every new shape).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
from jax.experimental.layout import Layout

from jaxinfer import compile_cache
from jaxinfer.engine.runner import direct_call
from jaxinfer.engine.runner.direct_call import DirectCall
from jaxinfer.executable_cache import ExecutableCache, program_key

logger = logging.getLogger(__name__)


class ProgramTable:
    """The compiled programs of one jitted function, by call key (see the module docstring)."""

    def __init__(
        self,
        jitted: Any,
        name: str,
        context: str,
        static_argnums: tuple = (),
        fixed: int = 0,
        fresh: Callable[[], Any] | None = None,
    ) -> None:
        self.jitted, self.name, self.context = jitted, name, context
        self._fresh, self._own = fresh, None
        self.static_argnums = static_argnums  # positional arguments the jit treats as static
        # NOTE: the leading `fixed` arguments keep their shapes for the runner's life (params,
        # caches, state): left out of the call signatures `jit_cache_size` counts
        self.fixed = fixed
        self.programs: dict[Any, Any] = {}
        self.jit_signatures: set[tuple] = set()
        self.first_use: ExecutableCache | None = None  # see the module docstring, step 5
        # keys the jit runs: their program refused its arguments' layouts or types (a key the
        # jit ran), or no direct call is possible for a key the jit ran
        self._jit_only: set[Any] = set()
        # key -> its program's `DirectCall` after a first checked call (False: not possible)
        self._direct: dict[Any, DirectCall | bool] = {}
        # keys the jit ran, and the `Compiled` of those it ran twice (`_repeated`): not counted
        # as programs (`__len__`, `jit_cache_size` count them as the jit's)
        self._jit_ran: set[Any] = set()
        self._repeats: dict[Any, Any] = {}

    @classmethod
    def of(
        cls, jit: Callable[..., Any], context: Callable[..., str], name: str, options: tuple, **kw
    ) -> ProgramTable:
        """The table of `jit(*options)` (a step / sampler / multi-step jit of `programs`), its
        executable-cache context `context(*options)` and fresh jits `jit(*options, shared=False)`;
        `kw`: `static_argnums`, `fixed`."""
        return cls(
            jit(*options),
            name,
            context(*options),
            fresh=lambda: jit(*options, shared=False),
            **kw,
        )

    def __len__(self) -> int:
        return len(self.programs)

    def __contains__(self, key: Any) -> bool:
        return key in self.programs

    def dynamic(self, args: tuple) -> tuple:
        """`args` without the static ones (what a `Compiled` takes)."""
        return tuple(a for i, a in enumerate(args) if i not in self.static_argnums)

    def __call__(self, key: Any, args: tuple, kwargs: dict) -> Any:
        program = self.programs.get(key)
        if program is None and self.first_use is not None and key not in self._jit_only:
            program = self._first_use(key, args, kwargs, self.first_use)
        if program is None:
            program = self._repeated(key, args, kwargs)
        if program is not None:
            dynamic = self.dynamic(args)
            direct = self._direct.get(key)
            if direct:  # NOTE: None when the arguments differ from its first call's
                out = direct(dynamic)
                if out is not None:
                    return out
            elif direct is None:  # made before the first checked call, used after it
                made = DirectCall.of(program, dynamic)
            try:
                out = program(*dynamic)
                if direct is None:
                    self._direct[key] = made or False
                return out
            except TypeError:  # NOTE: raised by the argument check, before anything ran
                # e.g. a wider suppress-ids table than warmup's: the jit builds that one (a key
                # the jit ran: the jit's from now on, no check and refusal before every call)
                if self._repeats.pop(key, None) is not None:
                    self._direct.pop(key, None)
                    self._jit_only.add(key)
            except ValueError as e:  # NOTE: the layout check, also before anything ran
                if "layouts" not in str(e):
                    raise
                # a layout the arrays lack (beyond the sub-byte quirk `_keep` lifts): the jit
                # runs them (every call: this key is the jit's from now on)
                logger.warning(
                    "a %s program refused its arguments' layouts; the jit compiles and runs "
                    "that shape from now on: %s",
                    self.name,
                    " ".join(str(e).split("\n")[:3]),
                )
                self.programs.pop(key, None)
                self._repeats.pop(key, None)
                self._direct.pop(key, None)
                self._jit_only.add(key)
        self.jit_signatures.add(self.signature(key, args))
        return self.jitted(*args, **kwargs)

    def _repeated(self, key: Any, args: tuple, kwargs: dict) -> Any:
        """The program of a key the jit ran before (step 3): from the jit's second call of it,
        its `Compiled` (the jit's own executable: lowering and compiling again hit JAX's
        in-memory caches, ~5 ms once), so that its calls can run directly. None: the jit runs
        it (a first call, or no direct call possible)."""
        program = self._repeats.get(key)
        if program is not None or key in self._jit_only or not direct_call.enabled():
            return program
        if key not in self._jit_ran:
            self._jit_ran.add(key)
            return None
        dynamic = self.dynamic(args)
        program = self.jitted.lower(*args, **kwargs).compile()
        _accept_subbyte_layouts(program, dynamic)
        if DirectCall.of(program, dynamic) is None:
            self._jit_only.add(key)  # NOTE: no gain over the jit's own call
            return None
        self._repeats[key] = program
        return program

    def signature(self, key: Any, args: tuple) -> tuple:
        """What picks this call's program in the jit beyond the fixed arguments (step 4)."""
        leaves = jax.tree.leaves(args[self.fixed :])
        return key, tuple(
            (type(x), getattr(x, "shape", None), getattr(x, "dtype", None))
            + (getattr(x, "weak_type", None), getattr(x, "sharding", None))
            for x in leaves
        )

    def _first_use(self, key: Any, args: tuple, kwargs: dict, cache: ExecutableCache) -> Any:
        disk_key = self.disk_key(args, kwargs)
        if cache.holds(disk_key):
            return self._load(key, args, kwargs, cache, disk_key)
        return self._compile(key, args, self._lower(cache, args, kwargs), cache, disk_key)

    def disk_key(self, args: tuple, kwargs: dict) -> str:
        """This call's key in the executable cache (`executable_cache.program_key`)."""
        statics = {**kwargs, **{f"arg{i}": args[i] for i in self.static_argnums}}
        return program_key(self.name, self.dynamic(args), statics, self.context)

    def jit_cache_size(self) -> int:
        return len(self.jit_signatures)

    def build(
        self,
        key: Any,
        args: tuple,
        kwargs: dict,
        cache: ExecutableCache | None,
        pool: ThreadPoolExecutor,
    ) -> tuple[Future, Any]:
        """Makes the program of this call (see the module docstring) on `pool`: loaded where the
        cache holds it, else lowered here and compiled there. Returns (the future of its
        `Compiled`, the `Lowered` or None when loading): either's `out_info` describes the
        results."""
        disk_key = None if cache is None else self.disk_key(args, kwargs)
        if cache is not None and cache.holds(disk_key):
            return pool.submit(self._load, key, args, kwargs, cache, disk_key), None
        lowered = self._lower(cache, args, kwargs)
        return pool.submit(self._compile, key, args, lowered, cache, disk_key), lowered

    def _lower(self, cache: ExecutableCache | None, args: tuple, kwargs: dict) -> Any:
        """The call lowered by the jit whose compiled program may be stored (step 2's NOTE)."""
        jitted = self.jitted
        if cache is not None and self._fresh is not None:
            if self._own is None:
                self._own = self._fresh()
            jitted = self._own
        return jitted.lower(*args, **kwargs)

    def _load(
        self, key: Any, args: tuple, kwargs: dict, cache: ExecutableCache, disk_key: str
    ) -> Any:
        program = cache.load(disk_key)
        if program is None:  # unusable (logged): compiled again, and stored whole
            return self._compile(key, args, self._lower(cache, args, kwargs), cache, disk_key)
        return self._keep(key, program, args)

    def _compile(
        self,
        key: Any,
        args: tuple,
        lowered: Any,
        cache: ExecutableCache | None,
        disk_key: str | None,
    ) -> Any:
        # NOTE: warmup compiles with JAX's persistent cache paused (always fresh); a first use
        # may read it, and such an executable is not stored (module docstring, step 5)
        compiled, fresh = compile_cache.compiled_fresh(lowered.compile)
        if cache is not None and fresh:
            cache.store(disk_key, compiled)
        return self._keep(key, compiled, args)

    def _keep(self, key: Any, program: Any, args: tuple) -> Any:
        """Keeps `program` under `key`, its layout check told of the sub-byte quirk of the
        arguments it was built for (`_accept_subbyte_layouts`) before its first call. NOTE: a
        `Compiled` whose first call failed that check never takes JAX's C++ fast path afterwards
        (every later call ran the Python checks over all ~470 arguments: half the int4 decode
        speed), hence before, not on refusal."""
        _accept_subbyte_layouts(program, self.dynamic(args))
        self._direct.pop(key, None)
        self.programs[key] = program
        return program


def _accept_subbyte_layouts(program: Any, dynamic: tuple) -> bool:
    """Lets `program` take the arrays whose layouts it refused when each refusal is the sub-byte
    quirk: XLA compiles a 4-bit parameter as `sub_byte_element_size_in_bits=4` (packed two per
    byte), while the 4-bit arrays it is given (the int4 weights' codes) report their layout with
    0 there though their buffers are the packed ones the program reads (jax 0.10: on XLA:CPU,
    also placed with the program's own `input_formats`). The jit runs such arrays unchecked; a
    `Compiled` refuses them (`ValueError`, nothing run). Drops those parameters from the
    program's layout check and returns True when every refused argument is of that kind (any
    other mismatch: False, the program unchanged)."""
    executable = getattr(program, "_executable", None)
    layouts = getattr(executable, "_xla_in_layouts", None)  # const args first, dead args gone
    kept = getattr(executable, "_kept_var_idx", None)  # indices: const args, then all args
    params = getattr(program, "_params", None)
    if layouts is None or kept is None or params is None:
        return False  # NOTE: not this jax's executable: the caller falls back to the jit
    consts = len(params.const_args)
    position = {index: p for p, index in enumerate(sorted(kept))}
    accepted = list(layouts)
    for i, arg in enumerate(jax.tree.leaves(dynamic)):
        p = position.get(consts + i)
        if p is None or not isinstance(arg, jax.Array) or not arg.committed:
            continue  # NOTE: the check skips dead and uncommitted arguments too
        want, have = layouts[p], arg.format.layout
        if want is None or have is None or want == have:
            continue
        bits = jax.dtypes.itemsize_bits(arg.dtype)
        quirk = bits < 8 and want.sub_byte_element_size_in_bits == bits
        if not quirk or have != Layout(want.major_to_minor, want.tiling):
            return False
        accepted[p] = None
    if accepted == list(layouts):
        return False
    executable._xla_in_layouts = type(layouts)(accepted)
    return True


__all__ = ["ProgramTable"]
