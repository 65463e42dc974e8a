"""gRPC serving of jaxinfer: `jaxinfer.v1.GenerateService` over one continuous-batching engine.

- `protos/jaxinfer/v1/generate.proto` — the API; generated stubs next to it
  (`serving.protos.jaxinfer.v1.generate_pb2`, `..._pb2_grpc`), rebuilt by `gen_protos.py`.
- `server.py` — `GenerateServer` (grpc.aio): validation, streaming, health, reflection, shutdown.
- `engine_loop.py` — the engine thread and per-request queues; `protocol.py` — proto <-> engine.
- `metrics.py` — Prometheus metrics; `client.py` — client helpers; `testing.py` — fake runner.
"""
