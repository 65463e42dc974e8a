"""The real served process for tests: `scripts/serve.py` in a subprocess over a tiny model.

1. `tiny_model_dir(root)` writes what a user would point `--model` at: a `config.json` of a
   2-layer Llama with SmolLM2's vocabulary (49,152 tokens) and that vocabulary as `tokenizer.json`
   + `tokenizer_config.json` (EOS, BOS, chat template). Served with `--load-format dummy`, so the
   weights are random but every path a real checkpoint takes after loading is the real one:
   the engine core in its own process, its tokenizer, the zmq messages, both protocols.
2. `ServedProcess(args)` starts `scripts/serve.py` on free ports (gRPC, metrics, and the OpenAI
   HTTP API), waits for "server ready", reads the ports from the start-up summary and keeps
   draining the log on a thread (a full pipe would block the server). `stop()` sends SIGTERM and
   returns the exit code (`wait()` after a signal the test sent); the log is kept for assertions.
3. `successor_model_dir(root)` is the same model with real weights (`model.safetensors`) built so
   its greedy output is known without running it: token i is followed by i + 1 (`successor`), so
   a served test compares whole token sequences with plain Python, in every dtype and
   quantization (the chosen token's logit leads the next one by ~15, far above any rounding).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
from engine_utils import TINY_LLAMA, load_vocab

ROOT = Path(__file__).resolve().parent.parent
SERVE = ROOT / "scripts" / "serve.py"


def tiny_model_dir(root: Path, chat_template: str | None = None) -> Path:
    """A `config.json` + tokenizer directory for `serve.py --load-format dummy` (its chat
    template: `chat_template`, default SmolLM2's)."""
    tok = load_vocab()  # skips the calling test without the embedded SmolLM2 vocabulary
    root.mkdir(parents=True, exist_ok=True)
    config = {
        **TINY_LLAMA,
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": tok.vocab_size,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": list(tok.eos_token_ids),
    }
    (root / "config.json").write_text(json.dumps(config))
    # NOTE: the SmolLM2 vocabulary is built from the GGUF's metadata as a `tokenizers` object;
    # saving that object is how a tokenizer.json for it is made without a model hub.
    tok._backend.tok.save(str(root / "tokenizer.json"))  # noqa: SLF001
    (root / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": tok.bos_token,
                "eos_token": tok.eos_token,
                "add_bos_token": False,
                "chat_template": chat_template or tok.chat_template,
            }
        )
    )
    return root


# NOTE: a 3-cycle for the penalty tests: 3000 -> 3001 -> 3002 -> 3000. After 3000 the runner-up
# is RUNNER_UP, whose logit is exactly 1 below 3001's (it has no predecessor of its own): any
# penalty of more than 1 on 3001 (or a top-k / top-p / min-p filter the other way) shows.
CYCLE = (3000, 3001, 3002)
RUNNER_UP = 3003
SUCCESSOR_LOGIT_SCALE = 0.5  # the chosen token's logit is 0.5 * hidden (64) = 32; others ~N(0, 4)


def successor(token: int, vocab_size: int) -> int:
    """The successor model's greedy next token."""
    return CYCLE[0] if token == CYCLE[-1] else (token + 1) % vocab_size


def successors(last: int, n: int, vocab_size: int) -> list[int]:
    """The successor model's greedy continuation of a prompt ending in `last` (EOS ignored)."""
    out = []
    for _ in range(n):
        last = successor(last, vocab_size)
        out.append(last)
    return out


def successor_model_dir(root: Path) -> Path:
    """`tiny_model_dir(root)` plus HF weights whose greedy next token is `successor(last token)`.

    The embedding rows are random with norm sqrt(hidden) (RMS 1); every layer's weights are tiny
    (std 0.02), so the residual stream stays the last token's embedding and the final norm hands it
    on unchanged; LM-head row j is `SUCCESSOR_LOGIT_SCALE` x the sum of the embeddings of the
    tokens j succeeds. So token j's logit after token i is 32 when j succeeds i and about
    N(0, 4) otherwise (the largest of 49k such: ~17).
    """
    from safetensors.numpy import save_file

    tiny_model_dir(root)
    cfg = json.loads((root / "config.json").read_text())
    vocab, hidden, inter = cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads, head_dim = (
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
    )
    rng = np.random.default_rng(0)
    embed = rng.standard_normal((vocab, hidden)).astype(np.float32)
    embed *= np.sqrt(hidden) / np.linalg.norm(embed, axis=1, keepdims=True)
    lm_head = np.zeros_like(embed)
    nxt = np.array([successor(i, vocab) for i in range(vocab)])
    np.add.at(lm_head, nxt, SUCCESSOR_LOGIT_SCALE * embed)
    lm_head[RUNNER_UP] = (SUCCESSOR_LOGIT_SCALE - 1 / hidden) * embed[CYCLE[0]]
    t = {"model.embed_tokens.weight": embed, "lm_head.weight": lm_head}
    t["model.norm.weight"] = np.ones(hidden, np.float32)

    def small(*shape: int) -> np.ndarray:
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)

    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = np.ones(hidden, np.float32)
        t[p + "post_attention_layernorm.weight"] = np.ones(hidden, np.float32)
        t[p + "self_attn.q_proj.weight"] = small(heads * head_dim, hidden)
        t[p + "self_attn.k_proj.weight"] = small(kv_heads * head_dim, hidden)
        t[p + "self_attn.v_proj.weight"] = small(kv_heads * head_dim, hidden)
        t[p + "self_attn.o_proj.weight"] = small(hidden, heads * head_dim)
        t[p + "mlp.gate_proj.weight"] = small(inter, hidden)
        t[p + "mlp.up_proj.weight"] = small(inter, hidden)
        t[p + "mlp.down_proj.weight"] = small(hidden, inter)
    save_file(t, str(root / "model.safetensors"))
    return root


# NOTE: the tiny served engines' step sizes: every decode of up to 4 sequences in one program,
# every longer step in the other (the default 1, 2, 4, ..., 64 compiles up to 7 per variant).
# The served modules share these shapes, so what one compiled the next loads from the
# executable cache (`jaxinfer.executable_cache.first_use_cache`): nothing traced again.
TINY_BUCKETS = ("--token-buckets", "4,64")


def serve_tiny(
    root: Path, *flags: str, chat_template: str | None = None, env: dict[str, str] | None = None
) -> ServedProcess:
    """`serve.py` over `tiny_model_dir(root, chat_template)` (dummy weights, no warmup, 4
    sequences, 64-token steps in `TINY_BUCKETS`, 64 pages, max_model_len 256); `flags` come last,
    so they override these; `env` adds to the process's environment."""
    model = tiny_model_dir(root, chat_template)
    base = ["--model", str(model), "--load-format", "dummy", "--no-warmup"]
    sizes = ["--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "64"]
    return ServedProcess([*base, *sizes, *TINY_BUCKETS, "--num-pages", "64", *flags], env=env)


def serve_fake(*flags: str) -> ServedProcess:
    """`serve.py --fake-runner` (10 ms steps, max_model_len 512, 65 pages); `flags` come last."""
    fake = ["--fake-runner", "--fake-step-delay", "0.01"]
    return ServedProcess([*fake, "--max-model-len", "512", "--num-pages", "65", *flags])


class ServedProcess:
    """`scripts/serve.py ARGS` on 127.0.0.1 with free gRPC, metrics and HTTP ports."""

    def __init__(
        self, args: list[str], *, ready_timeout: float = 240.0, env: dict[str, str] | None = None
    ) -> None:
        cmd = [
            sys.executable,
            str(SERVE),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--http-port",
            "0",
            *args,
        ]
        env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env
        )
        self.log: list[str] = []
        deadline = time.monotonic() + ready_timeout
        ready = False
        for line in self.proc.stderr:
            self.log.append(line)
            if "server ready" in line:
                ready = True
            if ready and re.search(r"^\s*http\s", line):  # the summary's last line
                break
            if time.monotonic() > deadline:
                break
        if not ready:
            self.proc.kill()
            raise RuntimeError("serve.py did not become ready:\n" + "".join(self.log[-40:]))
        text = "".join(self.log)
        self.grpc_address = "127.0.0.1:" + re.search(r"grpc\s+\S+?:(\d+)", text).group(1)
        http = re.search(r"(http://\S+?:(\d+)/v1)", text)
        self.http_url, self.http_port = http.group(1), int(http.group(2))
        self._drain = threading.Thread(target=self._read_rest, daemon=True)
        self._drain.start()

    def metric(self, name: str) -> float:
        """The value of sample `name` on the HTTP API's /metrics (the same registry as the metrics
        port, which `--no-metrics` drops), summed over its label sets; 0.0 when absent."""
        url = self.http_url.removesuffix("/v1") + "/metrics"
        text = urllib.request.urlopen(url, timeout=30).read().decode()
        found = re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
        return float(sum(float(v) for v in found))

    def _read_rest(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)

    def wait(self, timeout: float) -> int:
        """The exit code once the process has ended and its whole log is in `self.log`."""
        rc = self.proc.wait(timeout)
        self._drain.join(10)
        return rc

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.wait(10)
