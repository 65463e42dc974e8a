"""Multi-host (multi-process) serving: one leader drives every process's device step.

Every process runs the same compiled programs on one global mesh (each program is a collective
over all processes' devices), so every process must call the same jitted step with the same
inputs in the same order. Only process 0 (the leader) runs the scheduler and the gRPC server.

1. `initialize(coordinator, num_processes, process_id)` starts `jax.distributed` before anything
   touches a device (on CPU with the gloo collectives, so cross-process psums work there too).
2. `StepChannel` carries (control word, payload) from the leader to every process. Each message
   is one broadcast of a fixed-size frame: a header (magic, control, sequence number, payload
   length, flags) followed by the pickled payload when it fits (zlib-compressed when it would not
   fit raw); a larger payload follows in a second broadcast whose size (a power of two) every
   process reads from the header first. So shapes are known everywhere before data moves, and the
   broadcast programs compile once per size class.
3. On the leader, `attach_leader(runner, channel)` wraps the runner in a `LeaderRunner` (the
   engine core's runner from then on) that broadcasts before it runs: `warmup()` sends WARMUP,
   every step sends RUN with the prepared host inputs (a pytree of numpy arrays,
   `ModelRunner.prepare`'s output). The leader's engine is otherwise the
   single-process engine; steps with nothing scheduled never reach the runner, so idle costs no
   traffic.
4. On the others, `follow(runner, channel)` loops: receive → `runner.warmup()` / `runner.run(...)`
   → repeat, until SHUTDOWN, which the leader sends once on exit (`channel.shutdown()`).
5. `broadcast_config(value)` sends any picklable value once (e.g. the leader's resolved server
   flags), so that every process builds the same engine; `check_same_everywhere` then proves it
   (all processes compare a digest of their engine's configuration and fail together).
6. The runner moves data with `sharding.device_put_global` (host data every process holds in full onto a
   multi-process sharding, without `jax.device_put`'s per-leaf cross-process equality check)
   and `device_get` (results that span other processes' devices).

NOTE: results are used on the leader only, but every process fetches them (`device_get`): a
result sharded across processes needs an all-gather, which all of them must join.
NOTE: payloads are pickled: they only ever come from process 0 of the same job, over the JAX
collectives, never from clients.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
import time
import zlib
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxinfer.engine.types import RunnerOutput

logger = logging.getLogger(__name__)

RUN, WARMUP, DATA, SHUTDOWN = 1, 2, 3, 4
CONTROL_NAMES = {RUN: "run", WARMUP: "warmup", DATA: "data", SHUTDOWN: "shutdown"}

_MAGIC = 0x6A61_7869_6E66  # "jaxinf"
_HEADER_WORDS = 5  # magic, control, sequence number, payload bytes, flags
_HEADER_BYTES = _HEADER_WORDS * 8
_ZLIB = 1  # flags: the payload is zlib-compressed
# NOTE: a decode step of 64 sequences x 128-page tables pickles to ~40 KiB, ~10 KiB after zlib
# level 1 (0.5 ms to compress, 0.15 ms to expand); a second broadcast costs ~3 ms on loopback.
FRAME_BYTES = 16 << 10
_INLINE = FRAME_BYTES - _HEADER_BYTES


def initialize(coordinator_address: str, num_processes: int, process_id: int) -> None:
    """Starts `jax.distributed`; call it before anything else touches a device.

    Args:
      coordinator_address: "host:port" of process 0's coordination service (every process gives
        the same address; process 0 listens on its port).
      num_processes: how many processes form the job.
      process_id: this process's rank, 0 .. num_processes - 1 (0 is the leader).
    """
    if num_processes < 1:
        raise ValueError(f"--num-processes must be >= 1, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"--process-id must be in [0, {num_processes}), got {process_id}")
    if ":" not in coordinator_address:
        raise ValueError(f"--coordinator-address must be host:port, got {coordinator_address!r}")
    # NOTE: XLA:CPU needs a cross-process collectives implementation; gloo is the default in
    # jax 0.10 but is named explicitly so a changed default cannot turn psums into errors.
    if "jax_cpu_collectives_implementation" in jax.config.values:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address, num_processes=num_processes, process_id=process_id
    )
    logger.info(
        "process %d of %d: %d local devices of %d (%s)",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
        jax.devices()[0].platform,
    )


def is_leader() -> bool:
    return jax.process_index() == 0


def device_get(tree: Any) -> Any:
    """`jax.device_get(tree)` that also works on arrays spanning other processes' devices.

    A fully replicated array is read from a local shard; a sharded one (e.g. results split over
    a `data` axis that spans processes) is all-gathered, which is a collective: every process must
    call this in step (the runner's `run` does, on the leader and on every follower).
    """
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    leaves, treedef = jax.tree.flatten(tree)
    split = [
        i
        for i, x in enumerate(leaves)
        if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated
    ]
    for i in [i for i in split if not isinstance(leaves[i].sharding, NamedSharding)]:
        leaves[i] = multihost_utils.process_allgather(leaves[i], tiled=True)  # numpy
        split.remove(i)
    if split:
        # NOTE: one program replicates every split leaf (one collective launch per step, not one
        # per leaf as `multihost_utils.process_allgather` would do).
        replicated = tuple(NamedSharding(leaves[i].sharding.mesh, PartitionSpec()) for i in split)
        gathered = jax.jit(_identity, out_shardings=replicated)(*(leaves[i] for i in split))
        for i, x in zip(split, gathered, strict=True):
            leaves[i] = x
    out = [
        np.asarray(x.addressable_data(0))
        if isinstance(x, jax.Array) and not x.is_fully_addressable
        else jax.device_get(x)
        for x in leaves
    ]
    return jax.tree.unflatten(treedef, out)


def _identity(*xs: Any) -> tuple:
    return xs


def check_same_everywhere(what: str, value: Any) -> None:
    """Raises ValueError on every process unless `repr(value)` is equal on all of them.

    A collective (every process calls it at the same point). Processes that built different
    engines (another config.json, other flags) would otherwise compile different programs and
    wait on each other's collectives forever.
    """
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    digest = int.from_bytes(
        hashlib.sha256(repr(value).encode()).digest()[:8], "little", signed=True
    )
    digests = np.asarray(multihost_utils.process_allgather(np.array([digest], np.int64))).reshape(
        -1
    )
    odd = [i for i, d in enumerate(digests.tolist()) if d != digests[0]]
    if odd:
        raise ValueError(
            f"{what} differs between processes: process(es) {odd} disagree with "
            f"process 0 (this process {jax.process_index()}: {value!r}); start every "
            f"process with the same checkpoint and flags"
        )


def _broadcast(buf: np.ndarray) -> np.ndarray:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(buf))


def _size_class(nbytes: int) -> int:
    """Power of two >= nbytes (and >= 2 frames): few shapes, so few broadcast programs."""
    return max(2 * FRAME_BYTES, 1 << max(0, nbytes - 1).bit_length())


class ChannelError(RuntimeError):
    """The processes disagree about the message stream (a bug, or mismatched binaries)."""


class StepChannel:
    """Leader -> every process messages: (control word, picklable payload)."""

    def __init__(self) -> None:
        self.seq = 0  # messages so far; every process counts, and the header must agree
        self.closed = False
        self.bytes_sent = 0
        self.broadcasts = 0
        self.seconds = 0.0

    def send(self, control: int, payload: Any = None) -> None:
        """Leader only: broadcasts one message (every other process must be in `recv`)."""
        if not is_leader():
            raise ChannelError("only process 0 sends on the step channel")
        if self.closed:
            raise ChannelError("the step channel was shut down")
        start = time.perf_counter()
        body = b"" if payload is None else pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        flags = 0
        if len(body) > _INLINE:
            packed = zlib.compress(body, 1)
            if len(packed) < len(body):
                body, flags = packed, _ZLIB
        frame = np.zeros(FRAME_BYTES, np.uint8)
        frame[:_HEADER_BYTES] = np.array(
            [_MAGIC, control, self.seq, len(body), flags], np.int64
        ).view(np.uint8)
        inline = len(body) <= _INLINE
        if inline:
            frame[_HEADER_BYTES : _HEADER_BYTES + len(body)] = np.frombuffer(body, np.uint8)
        self._transfer(frame)
        if not inline:
            big = np.zeros(_size_class(len(body)), np.uint8)
            big[: len(body)] = np.frombuffer(body, np.uint8)
            self._transfer(big)
        self.seq += 1
        self.bytes_sent += len(body)
        self.seconds += time.perf_counter() - start
        if control == SHUTDOWN:
            self.closed = True

    def recv(self) -> tuple[int, Any]:
        """Every process but the leader: blocks until the leader's next message."""
        if is_leader():
            raise ChannelError("process 0 sends on the step channel; it never receives")
        frame = self._transfer(np.zeros(FRAME_BYTES, np.uint8))
        magic, control, seq, nbytes, flags = (int(v) for v in frame[:_HEADER_BYTES].view(np.int64))
        if magic != _MAGIC or control not in CONTROL_NAMES or flags not in (0, _ZLIB):
            raise ChannelError(
                f"corrupt step-channel header {[magic, control, seq, nbytes, flags]}"
            )
        if seq != self.seq:
            raise ChannelError(
                f"message {seq} arrived while message {self.seq} was expected: "
                f"the processes fell out of step"
            )
        if nbytes <= _INLINE:
            body = frame[_HEADER_BYTES : _HEADER_BYTES + nbytes].tobytes()
        else:
            body = self._transfer(np.zeros(_size_class(nbytes), np.uint8))[:nbytes].tobytes()
        self.seq += 1
        if control == SHUTDOWN:
            self.closed = True
        if flags & _ZLIB:
            body = zlib.decompress(body)
        return control, (pickle.loads(body) if nbytes else None)

    def _transfer(self, buf: np.ndarray) -> np.ndarray:
        self.broadcasts += 1
        return _broadcast(buf)

    def shutdown(self) -> None:
        """Leader: tells the followers to exit their loop (idempotent)."""
        if not self.closed:
            self.send(SHUTDOWN)


def broadcast_config(channel: StepChannel, value: Any = None) -> Any:
    """The leader's `value` on every process (followers pass nothing)."""
    if is_leader():
        channel.send(DATA, value)
        return value
    control, payload = channel.recv()
    if control != DATA:
        raise ChannelError(f"expected a data message, got {CONTROL_NAMES[control]!r}")
    return payload


class LeaderRunner:
    """The leader's `Runner`: broadcasts WARMUP / RUN (with the prepared host inputs) to the
    followers, then does the same itself with the `ModelRunner` it wraps.

    NOTE: every step is `execute`d (`synchronous_only`): the followers run exactly the leader's
    sequence of prepared steps, and the wrapped runner's prepare -> run -> unpack is kept.
    """

    synchronous_only = True
    split_sampling = False

    def __init__(self, runner: Any, channel: StepChannel) -> None:
        self.runner, self.channel = runner, channel

    @property
    def attention_backend(self) -> str:
        return self.runner.attention_backend

    @property
    def linear_backend(self) -> str:
        return self.runner.linear_backend

    @property
    def num_compiled(self) -> int:
        return self.runner.num_compiled

    def bytes_per_device(self) -> dict[str, int]:
        return self.runner.bytes_per_device()

    def warmup(self, *, structured: bool = False) -> int:
        self.channel.send(WARMUP)
        return self.runner.warmup()

    def execute(self, sched: Any) -> Any:
        prepared = self.runner.prepare(sched)
        if prepared is None:
            return RunnerOutput(sampled_token_ids={})
        self.channel.send(RUN, prepared)
        return self.runner.unpack(prepared.plan, *self.runner.run(prepared))

    def launch(self, sched: Any, *, defer_sampling: bool = False) -> Any:
        raise RuntimeError("a multi-host leader runs every step with execute()")

    def sample(self, launched: Any) -> None:
        raise RuntimeError("a multi-host leader runs every step with execute()")

    def collect(self, launched: Any) -> Any:
        raise RuntimeError("a multi-host leader runs every step with execute()")


def attach_leader(runner: Any, channel: StepChannel) -> LeaderRunner:
    """The leader's runner over `runner` (a `ModelRunner`): the engine core uses the result."""
    return LeaderRunner(runner, channel)


def follow(runner: Any, channel: StepChannel, *, on_step: Any = None) -> int:
    """A follower's whole life: run what the leader sends until SHUTDOWN; returns steps run.

    Args:
      runner: this process's `ModelRunner`, built exactly like the leader's.
      channel: the step channel.
      on_step: optional callback(prepared, results) after each step (tests record tokens).
    """
    steps = 0
    while True:
        control, payload = channel.recv()
        if control == RUN:
            results = runner.run(payload)
            steps += 1
            if on_step is not None:
                on_step(payload, results)
        elif control == WARMUP:
            runner.warmup()
        elif control == SHUTDOWN:
            logger.info("follower %d: shutdown after %d steps", jax.process_index(), steps)
            return steps
        else:
            raise ChannelError(
                f"a follower cannot handle a {CONTROL_NAMES[control]!r} message here"
            )
