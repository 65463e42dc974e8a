"""KV-cache events for cache-aware routers (llm-d, Dynamo): vLLM's `--kv-events-config`, its
`KVEventBatch` layout over ZMQ PUB with msgpack, so a router that reads vLLM reads us.

1. `KVEventsConfig.parse(text)` reads vLLM's JSON (`{"enable_kv_cache_events": true,
   "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv"}`; a "*" or "::" in the
   endpoint binds, anything else connects, as vLLM does).
2. `KVEventPublisher(config, allocators)` turns on each data replica's page allocator's event
   record (`PageAllocator.events`), binds its PUB socket and starts its sending thread.
3. `publish()`, called by the core loop after each engine step, takes every replica's records,
   coalesces them (consecutive stored pages of one chain: one `BlockStored`; consecutive
   removals: one `BlockRemoved`) and puts one batch per replica that has any on a bounded queue.
   The first batch starts with `AllBlocksCleared` (a new engine's cache is empty: a router drops
   what it knew of this endpoint's previous life). There is no cache-reset endpoint, so that is
   the only `AllBlocksCleared`.
4. The thread packs each batch and sends the frames (topic, sequence number as 8 big-endian
   bytes, payload), as vLLM's `ZmqEventPublisher` does.

Wire layout (msgpack, positional, as vLLM's array-like msgspec structs and its
`kv_events_subscriber.py` example): a batch is `[ts, [event, ...], data_parallel_rank]`; events
are `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]`,
`["BlockRemoved", block_hashes, medium]` and `["AllBlocksCleared"]`. A block hash is our 128-bit
chain hash (`page_allocator.chain_hash`) as 16 big-endian bytes (vLLM's `ExternalBlockHash` is
bytes or int; msgpack ints stop at 64 bits); the first page's parent is None; `lora_id` is None
(no LoRA yet); medium is "GPU" (vLLM's name for accelerator memory).

NOTE: the engine step never waits for a subscriber: the queue is bounded (`max_queue_size`
batches) and a full queue drops the batch (counted in `dropped`, logged once); a slow or absent
subscriber is ZMQ's high-water mark's business, on the thread.
NOTE: imports no JAX (the core loop imports it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

MEDIUM = "GPU"


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `KVEventsConfig` fields we honour (others are refused by `parse`)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    topic: str = ""
    hwm: int = 100_000
    max_queue_size: int = 100_000
    replay_endpoint: None = None
    buffer_steps: int = 10_000

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        """The config from its JSON text (ValueError naming a bad field)."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-events-config is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise ValueError(f"--kv-events-config: unknown field(s) {unknown}")
        cfg = cls(**raw)
        if cfg.publisher not in ("zmq", "null"):
            raise ValueError(
                f"--kv-events-config: publisher must be 'zmq' or 'null', got {cfg.publisher!r}"
            )
        if cfg.replay_endpoint is not None:
            raise ValueError("--kv-events-config: replay_endpoint is not supported")
        if cfg.max_queue_size < 1:
            raise ValueError("--kv-events-config: max_queue_size must be >= 1")
        return cfg

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def _hash(h: int) -> bytes:
    return h.to_bytes(16, "big")


def coalesce(records: Sequence[Any], page_size: int) -> list[list]:
    """vLLM events from one allocator's records (`(hash, parent, tokens)` stored, `hash` removed)."""
    events: list[list] = []
    last: int | None = None  # the hash of the last page of the open BlockStored
    for rec in records:
        if isinstance(rec, tuple):
            h, parent, tokens = rec
            ev = events[-1] if events else None
            if ev is not None and ev[0] == "BlockStored" and last == parent:
                ev[1].append(_hash(h))
                ev[3].extend(tokens)
            else:
                events.append(
                    [
                        "BlockStored",
                        [_hash(h)],
                        _hash(parent) if parent else None,
                        list(tokens),
                        page_size,
                        None,
                        MEDIUM,
                    ]
                )
            last = h
        else:
            if events and events[-1][0] == "BlockRemoved":
                events[-1][1].append(_hash(rec))
            else:
                events.append(["BlockRemoved", [_hash(rec)], MEDIUM])
            last = None
    return events


class KVEventPublisher:
    """Publishes the prefix cache's events of every data replica (see the module docstring)."""

    def __init__(self, config: KVEventsConfig, allocators: Sequence[Any]) -> None:
        import zmq

        self.config, self.allocators = config, list(allocators)
        for alloc in self.allocators:
            alloc.events = []
        self.dropped = 0
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._cleared = False
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 1000)
        ep = config.endpoint
        if "*" in ep or "::" in ep or ep.startswith(("ipc://", "inproc://")):
            self._pub.bind(ep)
        else:
            self._pub.connect(ep)
        self._topic = config.topic.encode()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info("KV events: publishing on %s (topic %r)", ep, config.topic)

    def publish(self) -> None:
        """Queues this step's events (engine thread; never blocks)."""
        now = time.time()
        for rank, alloc in enumerate(self.allocators):
            if not alloc.events and self._cleared:
                continue
            records, alloc.events = alloc.events, []
            events = coalesce(records, alloc.page_size)
            if not self._cleared:
                events.insert(0, ["AllBlocksCleared"])
            try:
                self._queue.put_nowait([now, events, rank])
            except queue.Full:
                if not self.dropped:
                    logger.warning("KV events: queue full, dropping batches (a slow sender)")
                self.dropped += 1
        self._cleared = True

    def _run(self) -> None:
        import msgpack

        seq = itertools.count()
        while True:
            batch = self._queue.get()
            if batch is None:
                break
            payload = msgpack.packb(batch, use_bin_type=True)
            try:
                self._pub.send_multipart([self._topic, next(seq).to_bytes(8, "big"), payload])
            except Exception:  # noqa: BLE001 - events are best effort; serving goes on
                logger.exception("KV events: send failed")

    def close(self) -> None:
        """Sends what is queued (the thread's last act), then closes the socket."""
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=1.0)
        self._thread.join(2.0)
        self._pub.close()
        self._ctx.term()
