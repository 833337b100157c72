import pytest

from tiny_checkpoints import make_checkpoint, tiny_llama_config


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """Path of a tiny random Llama checkpoint (2 layers, hidden 64) with a ChatML tokenizer."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny_llama"), tiny_llama_config())
