"""New architectures end to end: save_pretrained folder -> loader -> LLM.generate (greedy), compared
with transformers on the same folder. Covers on-disk naming (one tensor per expert), tied embeddings
(Gemma) and the engine's scheduling around the model."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams
from tiny_checkpoints import make_checkpoint

import test_deepseek
import test_gpt_oss
import test_sliding_window

pytestmark = pytest.mark.usefixtures("one_thread")

MAKERS = {
    "deepseek_v3": lambda: test_deepseek.tiny_v3(24, test_deepseek.YARN),
    "deepseek_v2": lambda: test_deepseek.tiny_v2(None, "greedy"),
    "gemma2": test_sliding_window.tiny_gemma2,
    "gemma3": test_sliding_window.tiny_gemma3,
    "gpt_oss": test_gpt_oss.tiny_gpt_oss,
}


@pytest.mark.parametrize("arch", list(MAKERS))
def test_generate_matches_transformers(arch, tmp_path):
    path = make_checkpoint(tmp_path, MAKERS[arch]().config)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    llm = LLM(model=str(path), dtype="float32", page_size=4, num_pages=64,
              progress=False)
    prompts = [list(range(5, 30)), list(range(40, 51))]  # both longer than the 8-token windows
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    for ids, out in zip(prompts, outs):
        seq = list(ids)
        with torch.no_grad():
            for _ in range(8):
                seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
        assert list(out.token_ids) == seq[len(ids):]


@pytest.mark.parametrize("arch", list(MAKERS))
def test_int8_weights_on_every_family(arch, tmp_path):
    """--quantization int8 swaps every linear layer the family lets it (not those whose weight
    the model reads directly, nor routers) and stays close to the float logits."""
    from deepinfer.quant.linear import QuantizedLinear

    path = make_checkpoint(tmp_path, MAKERS[arch]().config)
    ids = list(range(5, 30))
    logits = {}
    for scheme in ("none", "int8"):
        llm = LLM(model=str(path), dtype="float32", device="cpu", page_size=4, num_pages=64,
                  progress=False, quantization=scheme, host_cache_gb=0, enable_disk_cache=False)
        logits[scheme] = llm.engine.score([ids])[0][0]
    assert any(isinstance(m, QuantizedLinear) for m in llm.engine.runner.model.modules())
    scale = logits["none"].abs().max()  # (a near-tie in a tiny MoE's routing can flip an expert)
    assert (logits["int8"] - logits["none"]).abs().max() <= 0.1 * scale
