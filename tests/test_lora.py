"""Multi-LoRA (issue 34): PEFT adapters loaded into device slots give HF + PEFT's logprobs, alone
and mixed in one ragged batch with base-only rows; bad adapters are refused by name."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
if importlib.util.find_spec("peft") is None:
    pytest.skip("peft is not installed", allow_module_level=True)

from jaxinfer.config import ModelConfig  # noqa: E402
from jaxinfer.lora import device as lora_device  # noqa: E402
from jaxinfer.lora.adapter import LoRAError, load_adapter  # noqa: E402
from tests.model_utils import (  # noqa: E402
    PagedStepper,
    hf_config_dict,
    hf_logits,
    make_hf_model,
    params_from_torch,
)

TOL = 1e-3  # logprobs, f32
# rank 8 on q/v/down; rank 16 (rsLoRA scaling) on k/o/gate/up
ADAPTERS = {
    "a8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]),
    "b16": dict(
        r=16,
        lora_alpha=8,
        use_rslora=True,
        target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"],
    ),
}


def make_adapter(base, out_dir, seed: int, **kw) -> None:
    """A random PEFT LoRA adapter of `base` saved to `out_dir`."""
    import copy

    import peft  # NOTE: imported where used: both xdist workers collect this module

    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(init_lora_weights=False, **kw))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out_dir)


def peft_logits(base, path, toks) -> np.ndarray:
    import copy

    import peft

    model = peft.PeftModel.from_pretrained(copy.deepcopy(base), path).eval()
    with torch.no_grad():
        return model(torch.tensor([toks])).logits[0].float().numpy()


def _logprobs(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base, _ = make_hf_model("llama")
    cfg = ModelConfig.from_hf(hf_config_dict("llama"))
    paths = {}
    for seed, (name, kw) in enumerate(ADAPTERS.items()):
        paths[name] = str(root / name)
        make_adapter(base, paths[name], seed + 1, **kw)
    return base, cfg, params_from_torch(base, cfg), paths


def _tokens(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


def test_adapters_alone_and_mixed_match_peft(setup):
    base, cfg, params, paths = setup
    stacks = lora_device.empty_stacks(cfg, max_loras=3, max_lora_rank=16)
    # slot 1 stays empty, adapters in slots 2 and 3: slot order must not matter
    stacks = lora_device.write_slot(stacks, 2, load_adapter(paths["a8"], cfg, 16))
    stacks = lora_device.write_slot(stacks, 3, load_adapter(paths["b16"], cfg, 16))
    with_lora = lora_device.attach(params, stacks)
    seqs = {0: _tokens(9, 1), 1: _tokens(6, 2), 2: _tokens(7, 3), 3: _tokens(5, 4)}
    slots = {0: 2, 1: 3, 2: 0, 3: 2}  # a8, b16, base, a8
    refs = {
        0: peft_logits(base, paths["a8"], seqs[0]),
        1: peft_logits(base, paths["b16"], seqs[1]),
        2: hf_logits(base, seqs[2]),
        3: peft_logits(base, paths["a8"], seqs[3]),
    }
    for sid in (0, 1):  # each alone, prefill then one decode step
        stepper = PagedStepper(with_lora, cfg)
        (pre,) = stepper.step([(sid, seqs[sid][:-1])], lora_slots=slots)
        (dec,) = stepper.step([(sid, seqs[sid][-1:])], lora_slots=slots)
        got = _logprobs(np.concatenate([pre, dec]))
        assert np.abs(got - _logprobs(refs[sid])).max() <= TOL
        # the adapter matters: far from the base model's logprobs
        assert np.abs(got - _logprobs(hf_logits(base, seqs[sid]))).max() > 50 * TOL
    mixed = PagedStepper(with_lora, cfg).step(list(seqs.items()), pad_tokens=3, lora_slots=slots)
    for sid, out in zip(seqs, mixed):
        assert np.abs(_logprobs(out) - _logprobs(refs[sid])).max() <= TOL, sid


def test_bad_adapters_refused_by_name(setup, tmp_path):
    _, cfg, _, paths = setup
    with pytest.raises(LoRAError, match="max_lora_rank"):
        load_adapter(paths["b16"], cfg, 8)
    with pytest.raises(LoRAError, match="adapter_config.json"):
        load_adapter(str(tmp_path), cfg, 16)
    conf = json.loads(open_text(paths["a8"]))
    for field, value in [
        ("modules_to_save", ["lm_head"]),
        ("use_dora", True),
        ("target_modules", ["q_proj", "embed_tokens"]),
        ("bias", "all"),
    ]:
        (tmp_path / "adapter_config.json").write_text(json.dumps({**conf, field: value}))
        with pytest.raises(LoRAError, match=field) as err:
            load_adapter(str(tmp_path), cfg, 16)
        assert err.value.field == field
    (tmp_path / "adapter_config.json").write_text(json.dumps(conf))
    with pytest.raises(LoRAError, match="adapter_model.safetensors"):
        load_adapter(str(tmp_path), cfg, 16)
    other = ModelConfig.from_hf({**hf_config_dict("llama"), "hidden_size": 32})
    with pytest.raises(LoRAError, match="expected"):
        load_adapter(paths["a8"], other, 16)


def open_text(path: str) -> str:
    with open(f"{path}/adapter_config.json") as f:
        return f.read()


def _chosen_logprobs(ref_logits: np.ndarray, prompt_len: int, out_ids: list[int]) -> np.ndarray:
    lp = _logprobs(ref_logits)
    return np.array([lp[prompt_len - 1 + i, t] for i, t in enumerate(out_ids)])


@pytest.fixture(scope="module")
def model_dir(setup, tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    setup[0].save_pretrained(path, safe_serialization=True)
    return str(path)


def _lora_llm(model_dir: str, **options):
    """An `LLM` over the tiny base with multi-LoRA on (rank <= 16, pages of 4 tokens)."""
    from jaxinfer import LLM

    common = dict(dtype="float32", skip_tokenizer_init=True, enable_lora=True, max_lora_rank=16)
    return LLM(model_dir, **common, page_size=4, num_pages=64, max_num_seqs=4, **options)


def _assert_samples_match_peft(setup, outs, prompts, names) -> None:
    """Each output's sampled logprobs are HF's (name None) or HF + PEFT's with that adapter."""
    base, paths = setup[0], setup[3]
    for out, prompt, name in zip(outs, prompts, names, strict=True):
        ids = out.token_ids
        full = prompt + ids
        ref = hf_logits(base, full) if name is None else peft_logits(base, paths[name], full)
        got = np.array([lp[t] for lp, t in zip(out.logprobs, ids)])
        assert np.abs(got - _chosen_logprobs(ref, len(prompt), ids)).max() <= TOL, name


def test_llm_generate_with_lora_requests(setup, model_dir):
    """`LLM(enable_lora=True, max_loras=1)`: one prompt under a8, b16, the base and a8 again in one
    `generate`: b16 waits for a8's slot (never fails), the shared prompt's cached pages are not
    shared across adapters, each sample's logprobs match HF + PEFT; adapters add no programs."""
    from engine_utils import compile_events

    from jaxinfer import LoRARequest, SamplingParams

    paths = setup[3]
    llm = _lora_llm(
        model_dir,
        max_loras=1,
        max_cpu_loras=2,
        max_model_len=16,
        # NOTE: token buckets 1 and 2 only (6 programs): prompts prefill in chunks, 2 rows a step
        max_num_batched_tokens=2,
    )
    llm.engine.warmup()
    a8, b16 = LoRARequest("a8", 1, paths["a8"]), LoRARequest("b16", 2, paths["b16"])
    prompt = _tokens(9, 5)
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=0)
    # NOTE: warmup compiles without running: only compile events show a step program built again
    # (the adapters' slot writes are programs of their own, compiled on first use).
    with compile_events() as compiles:
        outs = llm.generate([prompt] * 4, sp, lora_request=[a8, b16, None, a8])
    assert not [c for c in compiles if "program" in c], compiles
    _assert_samples_match_peft(setup, outs, [prompt] * 4, ["a8", "b16", None, "a8"])
    with pytest.raises(ValueError, match="adapter_config.json"):
        llm.generate([prompt], sp, lora_request=LoRARequest("bad", 3, paths["b16"] + "/missing"))


def test_adapter_rows_burst_the_samples_of_single_steps(setup, model_dir):
    """Multi-step scheduling (`num_scheduler_steps=4`) with a8, b16 and the base in one batch:
    programs of 4 decode steps run, each token keeps its row's adapter slot in every step of one,
    and each sample's logprobs match HF + PEFT as single steps' do."""
    from engine_utils import counting_steps

    from jaxinfer import LoRARequest, SamplingParams

    paths = setup[3]
    llm = _lora_llm(
        model_dir,
        max_loras=2,
        max_model_len=24,
        max_num_batched_tokens=8,
        token_buckets=(8,),  # NOTE: one step program (and its 4-step one): prompts in one chunk
        num_scheduler_steps=4,
    )
    names = ["a8", "b16", None]
    requests = [LoRARequest("a8", 1, paths["a8"]), LoRARequest("b16", 2, paths["b16"]), None]
    prompts = [_tokens(6, 11 + i) for i in range(3)]
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)
    with counting_steps(llm.engine) as seen:
        outs = llm.generate(prompts, sp, lora_request=requests)
    assert max(seen) == 4, seen
    assert [len(out.token_ids) for out in outs] == [10] * 3
    _assert_samples_match_peft(setup, outs, prompts, names)


@pytest.mark.parametrize(
    "spec,backend", [("tensor=2", None), ("expert=2,tensor=2", None), ("tensor=2", "gpu")]
)
def test_mixed_batch_on_tensor_mesh_matches_peft(setup, spec, backend):
    """The stacks split as their base weights (`lora.device.AXES`) on a mesh of virtual CPU
    devices: KV heads split (tensor=2) or replicated (4 dense shards: expert x tensor on a dense
    model, 2 KV heads); a mixed batch matches HF + PEFT. `backend` "gpu": the GPU attention and
    LoRA kernels (`pallas_kernels.lora.gpu`) in interpret mode, under the `shard_map`."""
    import jax

    from jaxinfer import params as params_lib
    from jaxinfer import sharding as shd
    from jaxinfer.models import llama

    base, cfg, params, paths = setup
    sizes = shd.check_mesh(cfg, spec)
    mesh = shd.make_mesh(spec, devices=jax.devices()[: int(np.prod(list(sizes.values())))])
    rules = shd.model_rules(cfg, shd.Parallel.from_mesh(mesh))
    stacks = lora_device.empty_stacks(cfg, max_loras=2, max_lora_rank=16)
    stacks = lora_device.write_slot(stacks, 1, load_adapter(paths["a8"], cfg, 16))
    stacks = lora_device.write_slot(stacks, 2, load_adapter(paths["b16"], cfg, 16))
    stack_shardings = params_lib.shardings(lora_device.stack_specs(stacks), mesh, rules)
    placed = lora_device.attach(
        jax.device_put(params, params_lib.shardings(llama.param_specs(cfg), mesh, rules)),
        jax.device_put(stacks, stack_shardings),
    )
    seqs = {0: _tokens(9, 1), 1: _tokens(6, 2), 2: _tokens(7, 3)}
    slots = {0: 1, 1: 2, 2: 0}
    refs = [
        peft_logits(base, paths["a8"], seqs[0]),
        peft_logits(base, paths["b16"], seqs[1]),
        hf_logits(base, seqs[2]),
    ]
    stepper = PagedStepper(placed, cfg, mesh=mesh, attention_backend=backend)
    for sid, out in enumerate(stepper.step(list(seqs.items()), lora_slots=slots)):
        assert np.abs(_logprobs(out) - _logprobs(refs[sid])).max() <= TOL, (spec, sid)


def test_lora_refused_by_name_on_data_and_pipeline_meshes(model_dir):
    from jaxinfer import LLM

    for mesh in ("data=2,tensor=4", "pipeline=2,tensor=4"):
        with pytest.raises(ValueError, match="enable_lora: .*data or pipeline"):
            LLM(
                model_dir,
                dtype="float32",
                skip_tokenizer_init=True,
                enable_lora=True,
                mesh=mesh,
                page_size=4,
                num_pages=64,
                max_model_len=32,
                max_num_seqs=4,
            )


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_lora_over_quantized_base_weights(setup, fmt):
    """`quantization="int8"` / `"int4"` base weights: the adapters add to the quantized
    projections' outputs, so a mixed batch gives what LoRA over the dequantized (f32) base
    gives."""
    import jax

    from jaxinfer.models import llama
    from jaxinfer.params import is_spec
    from jaxinfer.quantization import dequantize, is_quantized, quantize_params

    base, cfg, params, paths = setup
    specs = llama.param_specs(cfg)
    q8 = quantize_params(params, specs, fmt)
    deq = jax.tree.map(
        lambda s, w: dequantize(w, s.quant_axis) if is_quantized(w) else w,
        specs,
        q8,
        is_leaf=is_spec,
    )
    stacks = lora_device.empty_stacks(cfg, max_loras=2, max_lora_rank=16)
    stacks = lora_device.write_slot(stacks, 1, load_adapter(paths["a8"], cfg, 16))
    stacks = lora_device.write_slot(stacks, 2, load_adapter(paths["b16"], cfg, 16))
    seqs = {0: _tokens(9, 1), 1: _tokens(6, 2), 2: _tokens(7, 3)}
    slots = {0: 1, 1: 2, 2: 0}
    got, want = (
        PagedStepper(lora_device.attach(p, stacks), cfg).step(list(seqs.items()), lora_slots=slots)
        for p in (q8, deq)
    )
    for sid in seqs:
        assert np.abs(_logprobs(got[sid]) - _logprobs(want[sid])).max() <= TOL, sid
    # the adapter matters over quantized weights too
    assert np.abs(_logprobs(got[0]) - _logprobs(hf_logits(base, seqs[0]))).max() > 50 * TOL
