"""What `scripts/serve.py` builds, in which process.

1. `EngineArgs` holds everything that shapes the engine (plain data: it travels to the spawned
   engine-core process); a bad mesh string fails as it is made, before any process starts (the
   checks that need the devices run in `build_core`).
2. `frontend_model(args)`: the front end's view of the model, its config and tokenizer without
   weights (no device is touched in the front-end process).
3. `build_core(args)` (the `CoreSpec` factory, run in the engine-core process, or in this one for
   multi-host and `--engine-in-process`): loads the weights onto the mesh and builds the
   `EngineCore`; with `fake_runner` a `FakeRunner` stands in for the model.

NOTE: importing this module loads no JAX (the front end imports it); `build_core` does.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

from jaxinfer.config import EngineConfig, parse_mesh
from jaxinfer.model_info import LoadedModel, load_model_info

if TYPE_CHECKING:
    from jaxinfer.engine.core import EngineCore


@dataclasses.dataclass
class EngineArgs:
    model: str | None = None
    dtype: str | None = None
    mesh: str = ""
    max_model_len: int | None = None  # None: 2048 on CPU (capped by the model), else the model's
    options: dict[str, Any] = dataclasses.field(default_factory=dict)  # EngineConfig fields
    attention_backend: str | None = None
    linear_backend: str | None = None
    fake_runner: bool = False
    fake_step_delay: float = 0.0
    fake_poison_token: int | None = None  # testing: a prompt holding it makes the step raise
    load_format: str = "auto"  # "dummy": random weights from the config
    # "int8" | "fp8" | "int4" (applied at load) | "gptq" | "awq" (the checkpoint's own format)
    quantization: str | None = None
    skip_tokenizer_init: bool = False  # no tokenizer: token ids in and out
    # None: $JAX_COMPILATION_CACHE_DIR, else ~/.cache/jaxinfer/xla; "": off (jaxinfer.compile_cache)
    compilation_cache_dir: str | None = None

    def __post_init__(self) -> None:
        parse_mesh(self.mesh)  # unknown axes and bad sizes, named
        if self.fake_poison_token is not None and not self.fake_runner:
            raise ValueError("fake_poison_token (--fake-poison-token) needs fake_runner")
        if self.fake_runner and self.skip_tokenizer_init:
            raise ValueError(
                "fake_runner takes its vocabulary from the tokenizer: it cannot run "
                "with skip_tokenizer_init"
            )


def frontend_model(args: EngineArgs) -> LoadedModel:
    """Name, config and tokenizer of the served model, without weights."""
    info = load_model_info(
        args.model, load_format=args.load_format, skip_tokenizer_init=args.skip_tokenizer_init
    )
    if args.fake_runner:
        from serving.testing import fake_model

        return fake_model(info.tokenizer, name=f"fake:{os.path.basename(info.path)}")
    return info


def build_core(args: EngineArgs) -> EngineCore:
    """Loads the model onto its mesh and builds the engine core (the device's process)."""
    from jaxinfer import compile_cache

    compile_cache.enable(args.compilation_cache_dir)  # NOTE: before anything compiles
    import jax

    from jaxinfer import executable_cache

    executable_cache.cache_first_use()  # a restart with --no-warmup traces nothing either

    from jaxinfer import sharding
    from jaxinfer.engine.core import EngineCore

    max_model_len = args.max_model_len
    if max_model_len is None and jax.default_backend() == "cpu":
        max_model_len = 2048
    mesh = sharding.make_mesh(args.mesh or None)  # raises saying what to change
    if args.fake_runner:
        from serving.testing import FakeRunner, fake_model

        model = fake_model(load_model_info(args.model, load_format=args.load_format).tokenizer)
        options = {"num_pages": 4097, **{k: v for k, v in args.options.items() if v is not None}}
        config = EngineConfig(max_model_len=max_model_len or 2048, **options)
        return EngineCore(
            model.cfg,
            None,
            config,
            tokenizer=model.tokenizer,
            runner=FakeRunner(step_delay=args.fake_step_delay, poison_token=args.fake_poison_token),
        )
    from jaxinfer.loader import load_model
    from jaxinfer.vision.encoder import load_encoder

    # NOTE: the core reads and writes token ids only, but structured output compiles grammars
    # against the vocabulary in the core (the matchers advance there, per step): it loads the
    # tokenizer unless the server runs without one. The front end still detokenizes.
    model = load_model(
        args.model,
        dtype=args.dtype,
        mesh=mesh,
        load_format=args.load_format,
        quantization=args.quantization,
        skip_tokenizer_init=args.skip_tokenizer_init,
    )
    if args.max_model_len is None and max_model_len:  # our CPU default, not the user's: cap it
        max_model_len = min(max_model_len, model.cfg.max_position_embeddings)
    config = EngineConfig(
        dtype=model.dtype,
        max_model_len=max_model_len,
        mesh=args.mesh,
        quantization=model.quantization,
        **args.options,
    )
    return EngineCore(
        model.cfg,
        model.params,
        config,
        attention_backend=args.attention_backend,
        linear_backend=args.linear_backend,
        tokenizer=model.tokenizer,
        vision=load_encoder(model),
    )
