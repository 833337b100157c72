"""Checkpoints from a local path: HF folders and GGUF files (converted once), tokenizer, fingerprint."""

from deepinfer.loader.checkpoint import Checkpoint, load_checkpoint
from deepinfer.loader.default_model import DEFAULT_MODEL_NAME, default_model_path

__all__ = ["Checkpoint", "DEFAULT_MODEL_NAME", "default_model_path", "load_checkpoint"]
