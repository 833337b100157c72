"""Turning a GGUF file into an HF-style folder once, so the rest of the engine sees one format.

transformers does the GGUF-specific work: its metadata mapping builds the config and the tokenizer,
and its per-architecture tensor processors undo what llama.cpp did to the weights (the Llama Q/K
row permutation, Gemma's `norm - 1`, ...). We drive its steps ourselves rather than calling
`AutoModelForCausalLM.from_pretrained(gguf_file=...)` (about 30 s for SmolLM2-135M) because that
path parses the whole metadata, vocabulary included, three times (about 6 s each for 49k tokens)
and rebuilds gguf's tensor-name table once per submodule; we also want our own progress bar.

Weights are saved as float32: the GGUF is quantised, and float32 holds its de-quantised values exactly.
Next to them, ``gguf_blocks.json`` says where each Q8_0/Q4 tensor's blocks are in the GGUF, so
``--quantization`` loads those blocks as they are instead of re-quantizing the float copy.
"""

import functools
import json
import os
import shutil
import tempfile
from pathlib import Path
from unittest import mock

import gguf as gguf_py
import numpy as np
import torch
from gguf import GGMLQuantizationType, dequantize
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    TokenizersBackend,
)
from transformers.integrations.gguf import GgufHeader, load_gguf_state_dict, read_gguf_metadata
from transformers.modeling_gguf_pytorch_utils import (
    TENSOR_PROCESSORS,
    TensorProcessor,
    get_gguf_hf_weights_map,
    load_gguf_checkpoint,
)
from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

from deepinfer.loader.eos import gguf_eos_ids
from deepinfer.quant.gguf_blocks import BLOCK_TYPES, BLOCKS_FILE, block_row_order

WEIGHTS_FILE = "model.safetensors"
CONVERSION_VERSION = 2  # 2: gguf_blocks.json added


def _register_block_sizes() -> None:
    """transformers' GGUF reader sizes tensors only of the types it can de-quantise itself; we
    de-quantise with gguf-py, which knows more (llama.cpp's Q4_K_M mixes in Q5_0, e.g. Gemma 3
    270M). Adding their (elements, bytes) per block lets the reader locate those tensors too."""
    from transformers.integrations.gguf import dequant

    for qtype, (elements, nbytes) in gguf_py.GGML_QUANT_SIZES.items():
        if elements > 1:  # block-quantised (plain float/int types are read as they are)
            dequant.GGML_BLOCK.setdefault(int(qtype), (elements, nbytes))


_register_block_sizes()


def convert_gguf(gguf: Path, target: Path, progress: bool = True) -> None:
    """Write `target` (config.json, model.safetensors, tokenizer, generation_config.json) from `gguf`.

    Atomic: everything goes into a temporary sibling folder that is renamed to `target` at the end,
    so an interrupted conversion never leaves a folder that looks loadable.
    """
    metadata, _ = read_gguf_metadata(str(gguf))  # fast: leaves the vocabulary unread
    architecture = metadata["general.architecture"]
    header = GgufHeader.from_file(str(gguf))
    # one step per tensor, plus metadata, tokenizer and writing (the first takes seconds too)
    with tqdm(total=len(header.tensors) + 3, desc=f"Converting {gguf.name}", disable=not progress) as bar:
        bar.set_postfix_str("metadata")
        try:
            parsed = load_gguf_checkpoint(str(gguf))  # config and tokenizer metadata, no tensors
            config = AutoConfig.for_model(**parsed["config"])
            with torch.device("meta"):  # only for parameter names: no memory, no init
                skeleton = AutoModelForCausalLM.from_config(config)
        except (ValueError, KeyError) as e:
            raise ValueError(f"{gguf}: cannot convert GGUF architecture {architecture!r}: {e}") from e
        config.architectures = [type(skeleton).__name__]
        config.dtype = torch.float32
        bar.update()

        bar.set_postfix_str("tensors")
        tensors, blocks = _dequantized_tensors(header, architecture, parsed, skeleton, bar)

        bar.set_postfix_str("tokenizer")
        tokenizer = _gguf_tokenizer(gguf, config)
        generation_config = GenerationConfig(
            bos_token_id=config.bos_token_id,
            eos_token_id=gguf_eos_ids(metadata, config, tokenizer.get_vocab()),
            pad_token_id=getattr(config, "pad_token_id", None),
        )
        bar.update()

        bar.set_postfix_str("writing")
        _write_atomically(target, tensors, blocks, config, tokenizer, generation_config)
        bar.update()


def _write_atomically(
    target: Path,
    tensors: dict[str, torch.Tensor],
    blocks: dict[str, dict],
    config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase,
    generation_config: GenerationConfig,
) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        # A single metadata key: safetensors writes them in (per-process random) hash order, and
        # the fingerprint is over the bytes, so two keys made identical weights hash differently.
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / BLOCKS_FILE).write_text(json.dumps({"tensors": blocks}))
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        generation_config.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():  # anything but "another process finished first"
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _dequantized_tensors(
    header: GgufHeader, architecture: str, parsed: dict, skeleton: torch.nn.Module, bar: tqdm
) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """HF name -> float32 tensor, through transformers' name map and tensor processor for the
    architecture; and HF name -> where the tensor's quantized blocks are (``quant/gguf_blocks.py``).

    Mirrors the tensor loop of `load_gguf_checkpoint`; processors that assemble one HF tensor from
    several GGUF ones (MoE experts) write into `parsed["tensors"]` themselves, hence the shared dict.
    """
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed["config"])
    # It rebuilds gguf's name table, a pure function of (architecture, depth), for every submodule
    # it recurses into: 400 times for a 30-layer model, tens of seconds, unless memoised.
    with mock.patch.object(gguf_py, "get_tensor_name_map", functools.cache(gguf_py.get_tensor_name_map)):
        name_map = get_gguf_hf_weights_map(skeleton, processor)
    parsed["tensors"] = tensors = {}
    block_map: dict[str, dict] = {}
    raw = load_gguf_state_dict(header)
    for info in header.tensors:
        # bytes laid out row by row; gguf's dequantize turns (rows, row_bytes) into (rows, columns)
        blocks = np.asarray(raw[info.name].data).reshape(*info.shape[:-1], -1)
        weights = dequantize(blocks, GGMLQuantizationType(info.ggml_type))
        result = processor.process(
            weights=weights, name=info.name, tensor_key_mapping=name_map, parsed_parameters=parsed
        )
        if result.name in name_map:  # tensors the model has no parameter for (e.g. rope_freqs) are dropped
            tensors[name_map[result.name]] = torch.from_numpy(np.array(result.weights, dtype=np.float32))
            qtype = GGMLQuantizationType(info.ggml_type).name
            if qtype in BLOCK_TYPES and len(info.shape) == 2:
                order = block_row_order(functools.partial(_process_alone, processor, info.name, name_map,
                                                          parsed["config"]), info.shape[0])
                if order is not False:
                    block_map[name_map[result.name]] = {"gguf": info.name, "type": qtype, "rows": order}
        bar.update()
    return tensors, block_map


def _process_alone(processor: TensorProcessor, name: str, name_map: dict, config: dict,
                   weights: np.ndarray) -> np.ndarray:
    """The processor applied to stand-in ``weights`` without touching the real parsed tensors."""
    return processor.process(weights=weights, name=name, tensor_key_mapping=name_map,
                             parsed_parameters={"config": config, "tensors": {}}).weights


def _gguf_tokenizer(gguf: Path, config: PretrainedConfig) -> PreTrainedTokenizerBase:
    """The tokenizer transformers builds from the GGUF metadata (vocabulary, merges, chat template).

    Picks the class the way `AutoTokenizer.from_pretrained(gguf_file=...)` does for a bare GGUF,
    which would first parse the whole file again just to rebuild the config we already have.
    """
    tokenizer_class = TOKENIZER_MAPPING.get(type(config), None) or TokenizersBackend
    return tokenizer_class.from_pretrained(gguf.parent, gguf_file=gguf.name)
