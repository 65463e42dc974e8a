"""A DeepSeek-V3-shaped MoE model with MLA attention served on an expert-parallel mesh.

The real `scripts/serve.py` process pair serves a tiny random DeepSeek-V3 (3 layers: one dense,
two with 8 routed experts + a shared one, MLA attention with a LoRA'd query, YaRN rope), saved by
transformers as a user's checkpoint would be (`config.json` + `model.safetensors`), on a
`expert=2,tensor=2` mesh of 4 virtual CPU devices; its greedy tokens for two prompts decoded
side by side must equal transformers' own greedy continuation of each prompt (the independent
reference: no jaxinfer code computes it). The weights are scaled so logits are far from flat
(`model_utils.make_hf_model`), so a wrong expert route, rope or latent-cache read changes tokens.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from served_utils import ServedProcess

from serving.client import GenerateClient

pytest.importorskip("torch")
pytest.importorskip("transformers")

PROMPTS = ([7, 100, 31, 250, 9, 64, 12, 5, 90], [201, 3, 77, 18, 160, 45])  # vocabulary: 256
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    from model_utils import make_hf_model

    model, _ = make_hf_model("deepseek_v3")
    path = tmp_path_factory.mktemp("deepseek") / "ckpt"
    model.save_pretrained(str(path), safe_serialization=True)
    return model, path


@pytest.fixture(scope="module")
def served(hf_model):
    _, path = hf_model
    srv = ServedProcess(
        [
            *("--model", str(path), "--skip-tokenizer-init", "--no-warmup"),
            *("--mesh", "expert=2,tensor=2", "--max-model-len", "64", "--page-size", "4"),
            *("--num-pages", "32", "--max-num-seqs", "2", "--max-num-batched-tokens", "16"),
            *("--token-buckets", "2,16"),  # NOTE: the decodes in one program, prefill in one
        ],
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
    )
    yield srv
    assert srv.stop() == 0, "".join(srv.log[-30:])


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    from model_utils import hf_logits

    ids = list(prompt)
    for _ in range(n):
        ids.append(int(np.argmax(hf_logits(model, ids)[-1])))
    return ids[len(prompt) :]


def test_deepseek_moe_on_an_expert_mesh_decodes_transformers_tokens(hf_model, served):
    model, _ = hf_model
    want = {i: _hf_greedy(model, p, NEW_TOKENS) for i, p in enumerate(PROMPTS)}
    got: dict[int, list[int]] = {}

    def run(i: int) -> None:
        with GenerateClient(served.grpc_address) as c:
            msgs = c.generate(
                list(PROMPTS[i]), max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, timeout=300
            )
            got[i] = [t for m in msgs for t in m.token_ids]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(400)
    assert got == want
    with GenerateClient(served.grpc_address) as c:
        info = c.model_info()
    assert dict(info.mesh_shape) == {"data": 1, "pipeline": 1, "tensor": 2, "expert": 2}
