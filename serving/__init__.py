"""Serving of jaxinfer: gRPC (`jaxinfer.v1.GenerateService`) and the OpenAI-compatible HTTP API
over one continuous-batching engine.

- `protos/jaxinfer/v1/generate.proto` — the gRPC API; generated stubs next to it
  (`serving.protos.jaxinfer.v1.generate_pb2`, `..._pb2_grpc`), rebuilt by `gen_protos.py`.
- `frontend.py` — `FrontEnd`: admission, prompt checks, tokenization, lifecycle, metrics;
  `engine_loop.py` — its messages to and from the engine core, per-request `Stream`s;
  `errors.py` — the front end's errors, which each protocol maps to its code.
- `server.py` — `GenerateServer` (grpc.aio) with `protocol.py` (proto <-> engine); `http_server.py`
  — `OpenAIServer` (FastAPI) with `openai_protocol.py`: peers over a `FrontEnd`.
- `metrics.py` — Prometheus metrics (+ `vllm_metrics.py`: vLLM's names); `client.py` — client helpers; `launch.py` — what
  `scripts/serve.py` builds; `testing.py` — fake runner.
"""
