"""Which token ids end generation.

Checkpoints state this in up to three places that often disagree (generation_config.json may list
several ids, config.json one, the tokenizer its eos token), and chat models end a turn with a token
that is not always among them. The engine stops on any of the ids collected here.
"""

import json
from pathlib import Path

from transformers import PretrainedConfig, PreTrainedTokenizerBase

# Tokens that end a turn in common chat templates. llama.cpp stops on these texts whatever the GGUF's
# eos id says, so a GGUF conversion lists them as eos when the chat template writes them.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<turn|>")


def as_id_list(value: int | list[int] | None) -> list[int]:
    """Token id fields hold an int, a list of ints, or nothing."""
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def checkpoint_eos_ids(
    folder: Path, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase
) -> list[int]:
    """generation_config.json's, then config's, then the tokenizer's eos ids, without repeats."""
    ids = []
    generation_config = folder / "generation_config.json"
    if generation_config.is_file():
        ids += as_id_list(json.loads(generation_config.read_text()).get("eos_token_id"))
    ids += as_id_list(getattr(config.get_text_config(), "eos_token_id", None))
    ids += as_id_list(tokenizer.eos_token_id)
    return list(dict.fromkeys(ids))


def gguf_eos_ids(metadata: dict, config: PretrainedConfig, vocab: dict[str, int]) -> list[int]:
    """For a GGUF: config eos, the file's eos/eot/eom ids, and end-of-turn tokens its chat template writes."""
    ids = as_id_list(getattr(config, "eos_token_id", None))
    for kind in ("eos", "eot", "eom"):
        ids += as_id_list(metadata.get(f"tokenizer.ggml.{kind}_token_id"))
    template = metadata.get("tokenizer.chat_template") or ""
    ids += [vocab[token] for token in END_OF_TURN_TOKENS if token in template and token in vocab]
    return list(dict.fromkeys(ids))
