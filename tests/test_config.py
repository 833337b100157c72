"""Device and dtype resolution of ``EngineConfig``: "auto" follows $DEEPINFER_DEVICE /
$DEEPINFER_DTYPE (how the suite runs on $DEEPINFER_TEST_DEVICE), explicit values win."""

import torch

from deepinfer.config import EngineConfig


def test_auto_follows_the_environment(monkeypatch, test_device):
    assert EngineConfig().torch_device() == torch.device(test_device)  # conftest pins the suite
    assert EngineConfig().torch_dtype() == torch.float32
    monkeypatch.setenv("DEEPINFER_DEVICE", "meta")
    monkeypatch.setenv("DEEPINFER_DTYPE", "bfloat16")
    assert EngineConfig().torch_device() == torch.device("meta")
    assert EngineConfig().torch_dtype() == torch.bfloat16
    assert EngineConfig(device="cpu", dtype="float16").torch_device() == torch.device("cpu")
    assert EngineConfig(device="cpu", dtype="float16").torch_dtype() == torch.float16
    monkeypatch.delenv("DEEPINFER_DEVICE")
    monkeypatch.delenv("DEEPINFER_DTYPE")
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert EngineConfig().torch_device() == torch.device(want)
