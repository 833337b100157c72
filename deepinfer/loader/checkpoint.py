"""`load_checkpoint`: any supported model path -> a `Checkpoint` the engine can build a model from."""

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from deepinfer.loader.cache import cache_dir
from deepinfer.loader.default_model import DEFAULT_MODEL_NAME, default_model_path
from deepinfer.loader.eos import checkpoint_eos_ids
from deepinfer.loader.fingerprint import file_digest, fingerprint
from deepinfer.loader.gguf_convert import CONVERSION_VERSION, convert_gguf

SHARD_INDEX = "model.safetensors.index.json"


@dataclass
class Checkpoint:
    """A model on disk in HF layout: config, tokenizer and identity loaded, weights read on demand."""

    name: str  # shown in the API
    path: Path  # the HF-style folder actually loaded (for a GGUF: its converted copy in the cache)
    config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase
    fingerprint: str  # hex content hash of the weight files: the model's identity for the KV cache
    eos_token_ids: list[int]
    gguf: Path | None = None  # the source GGUF, whose quantized blocks --quantization can load as they are

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF parameter name, tensor) pairs in the stored dtype, read one at a time from the files."""
        for file in weight_files(self.path):
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)


def load_checkpoint(path: str | os.PathLike | None, progress: bool = True) -> Checkpoint:
    """Load an HF folder, or a `.gguf` file (converted once into the cache), or the default model for None."""
    if path is None:
        return _load_gguf(default_model_path(), DEFAULT_MODEL_NAME, progress)
    path = Path(path).expanduser()
    if not path.exists():
        raise ValueError(f"Model path {path} does not exist.")
    if path.is_dir():
        return load_folder(path, path.resolve().name)
    if path.suffix.lower() == ".gguf":
        return _load_gguf(path, path.stem, progress)
    raise ValueError(f"Model path {path} is neither a folder (config.json + *.safetensors) nor a .gguf file.")


def load_folder(folder: Path, name: str) -> Checkpoint:
    """An HF folder: config.json, *.safetensors (maybe sharded), tokenizer files, generation_config.json."""
    if not (folder / "config.json").is_file():
        ggufs = sorted(folder.glob("*.gguf"))
        hint = f" To load a GGUF, pass the file itself, e.g. {ggufs[0]}." if ggufs else ""
        raise ValueError(f"{folder} has no config.json, so it is not a Hugging Face model folder.{hint}")
    files = weight_files(folder)
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"{folder}: cannot load a tokenizer from it ({e}).") from e
    return Checkpoint(
        name=name,
        path=folder.resolve(),
        config=config,
        tokenizer=tokenizer,
        fingerprint=fingerprint(files),
        eos_token_ids=checkpoint_eos_ids(folder, config, tokenizer),
    )


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files holding the weights: those the shard index names, else every *.safetensors."""
    index = folder / SHARD_INDEX
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / name for name in names]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} holds no *.safetensors weights (other formats are not supported).")
    return files


def converted_gguf_dir(gguf: Path) -> Path:
    """Where the HF copy of a GGUF lives: keyed by content, so an edited file is converted again,
    and by the conversion's format version, so a copy missing newer files is converted again too."""
    return cache_dir() / "models" / f"{gguf.stem}-{file_digest(gguf)[:16]}-v{CONVERSION_VERSION}"


def _load_gguf(gguf: Path, name: str, progress: bool) -> Checkpoint:
    target = converted_gguf_dir(gguf)
    if not target.is_dir():  # complete if present: conversions appear by atomic rename
        convert_gguf(gguf, target, progress=progress)
    ckpt = load_folder(target, name)
    ckpt.gguf = gguf
    return ckpt
