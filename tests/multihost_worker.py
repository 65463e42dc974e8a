"""One process of the 2-process tests in test_multihost.py (run as a script, never collected).

    python tests/multihost_worker.py --port P --process-id I --model DIR --out DIR [--mesh SPEC]

1. Give this process 4 virtual CPU devices, then `multihost.initialize` (2 processes, loopback).
2. Mechanics: a psum over all 8 devices of both processes; a step-channel round trip of a small
   (one-frame) and a large (two-broadcast) payload; the engine options from the leader; a
   configuration that differs between processes is detected on both, an equal one passes.
3. Build the same engine on every process: the model from DIR on `--mesh` over the 8 global
   devices (no mesh: each process its own single device, which still exercises the protocol).
   The leader attaches the broadcasting runner, warms up, generates greedily, shuts the channel
   down; the follower follows. Each writes what it saw to OUT/process_<i>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __name__ == "__main__":  # NOTE: not on import: pytest imports this module while collecting
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"  # test_multihost.py, and
    # setting it then would give every other test in that process 4 devices instead of 8.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxinfer.engine import multihost  # noqa: E402
from jaxinfer.sharding import device_put_global  # noqa: E402

# NOTE: a 2-token budget and one 2-token bucket keep every process's warmup to 2 programs (the
# 2 logits variants; a 1-token step pads to 2, as on the pipeline mesh); prompts are prefilled in
# 2-token chunks (more steps, each one a channel round trip the follower must replay), decodes of
# 3 requests split over steps.
ENGINE = dict(
    page_size=4,
    num_pages=34,
    max_model_len=32,
    max_num_seqs=4,
    max_num_batched_tokens=2,
    token_buckets=(2,),
)
PROMPTS = [[5, 17, 33, 101, 7, 9], [200, 3, 42], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
MAX_TOKENS = 6


def psum_across_processes() -> float:
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("all",))
    x = device_put_global(np.arange(8, dtype=np.float32), NamedSharding(mesh, PartitionSpec("all")))
    total = jax.jit(
        jax.shard_map(
            lambda v: jax.lax.psum(v, "all"),
            mesh=mesh,
            in_specs=PartitionSpec("all"),
            out_specs=PartitionSpec(),
        )
    )(x)
    return float(np.asarray(total.addressable_data(0))[0])


def channel_round_trip(channel: multihost.StepChannel) -> dict:
    rng = np.random.default_rng(0)
    small = {"ids": np.arange(10, dtype=np.int32), "flag": True}
    large = {"page_indices": rng.integers(0, 2**31 - 1, (64, 128), dtype=np.int32), "bucket": 512}
    got = [
        multihost.broadcast_config(channel, v if multihost.is_leader() else None)
        for v in (small, large)
    ]
    ok = (
        np.array_equal(got[0]["ids"], small["ids"])
        and got[0]["flag"] is True
        and np.array_equal(got[1]["page_indices"], large["page_indices"])
        and got[1]["bucket"] == 512
    )
    return {"round_trip_ok": bool(ok), "broadcasts": channel.broadcasts}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--mesh", default="")
    args = p.parse_args()
    multihost.initialize(f"127.0.0.1:{args.port}", 2, args.process_id)
    report: dict = {
        "process_index": jax.process_index(),
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
    }
    report["psum"] = psum_across_processes()
    channel = multihost.StepChannel()
    report.update(channel_round_trip(channel))
    options = multihost.broadcast_config(channel, dict(ENGINE) if multihost.is_leader() else None)
    try:
        multihost.check_same_everywhere("the engine options", {**options, "me": args.process_id})
        report["mismatch_detected"] = False
    except ValueError as e:
        report["mismatch_detected"] = "differs between processes: process(es) [1]" in str(e)
    multihost.check_same_everywhere("the engine options", options)

    from jaxinfer import sharding
    from jaxinfer.config import EngineConfig
    from jaxinfer.engine.engine import LLMEngine, wait_all
    from jaxinfer.loader import load_model
    from jaxinfer.sampling_params import SamplingParams

    # NOTE: jax.devices()[0] belongs to process 0; without a mesh each process uses its own device.
    mesh = sharding.make_mesh(args.mesh or None, devices=None if args.mesh else jax.local_devices())
    config = EngineConfig(**options, **({"mesh": args.mesh} if args.mesh else {}))
    engine = LLMEngine(load_model(args.model, mesh=mesh), config)
    steps: list[list[int]] = []

    max_num_seqs = engine.runner.max_num_seqs  # (the leader's runner is wrapped below)

    def record(prepared, results) -> None:
        seq_rows = prepared.inputs["extras"].seq_rows  # padding rows hold the spare row
        rows = np.flatnonzero(seq_rows < max_num_seqs)  # the scheduled requests' rows
        steps.append(np.asarray(results[0])[rows].tolist())

    if multihost.is_leader():
        leader = engine.runner = multihost.attach_leader(engine.runner, channel)
        runner = leader.runner
        run = runner.run

        def recording_run(prepared):
            results = run(prepared)
            record(prepared, results)
            return results

        runner.run = recording_run
        report["compiled"] = leader.warmup()
        for i, ids in enumerate(PROMPTS):
            engine.add_request(
                ids,
                SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                request_id=f"p{i}",
            )
        tokens: dict[str, list[int]] = {}
        for d in wait_all(engine, timeout=300):
            tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
        channel.shutdown()
        report["tokens"] = [tokens[f"p{i}"] for i in range(len(PROMPTS))]
        report["channel_seconds"] = channel.seconds
        report["channel_bytes"] = channel.bytes_sent
    else:
        warmup = engine.runner.warmup

        def counting_warmup() -> int:
            report["compiled"] = warmup()
            return report["compiled"]

        engine.runner.warmup = counting_warmup
        report["followed"] = multihost.follow(engine.runner, channel, on_step=record)
    report["steps"] = steps
    report["messages"] = channel.seq
    with open(os.path.join(args.out, f"process_{args.process_id}.json"), "w") as f:
        json.dump(report, f)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
