"""Teacher-forced accuracy of ``--quantization`` on SmolLM2-135M against the unquantized model.

Sequences: the first 160 tokens of 2 of the lossless greedy generations in
``tests/data/smollm2_greedy256.json``; every position is scored in one prefill, so an early
disagreement cannot cascade. Two sources:

* the embedded GGUF (Q4_1 layers, a Q8_0 embedding that is also the LM head): its blocks load as
  they are, so int8 and int4 hold exactly the weights the float reference runs; the logits must
  match bit for bit (the de-quantize kernel computes the same matmuls).
* the GGUF's float copy loaded as a plain HF folder: the weights are quantized from float
  (int8 symmetric in groups of 32, int4 asymmetric in groups of 32), the case of any HF checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deepinfer.bench.accuracy import compare
from deepinfer.layers.prepacked_linear import DISABLE_ENV as DISABLE_PREPACK

DATA = Path(__file__).parent.parent / "data" / "smollm2_greedy256.json"
ENGINE = dict(progress=False, host_cache_gb=0, enable_disk_cache=False, enable_prefix_cache=False)


@pytest.fixture(scope="module")
def smollm2():
    try:
        from deepinfer.loader import default_model_path

        gguf = default_model_path()
    except (ImportError, ModuleNotFoundError) as e:
        pytest.skip(f"SmolLM2 not available: {e}")
    from deepinfer.llm import LLM
    from deepinfer.loader.checkpoint import converted_gguf_dir

    data = json.loads(DATA.read_text())
    seqs = [(p + g)[:160] for p, g in zip(data["prompt_token_ids"], data["generated_token_ids"])][:2]
    # the reference's prefill runs F.linear, as the quantized models' de-quantized prefill does
    # (oneDNN's prepacked fp32 GEMM rounds differently, so its bits would not match)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(DISABLE_PREPACK, "1")
        reference = LLM(None, **ENGINE)
    ref = [logits for logits, _ in reference.engine.score(seqs)]
    return seqs, ref, converted_gguf_dir(gguf)


def _score(model, seqs, **args):
    from deepinfer.llm import LLM

    llm = LLM(model, **ENGINE, **args)
    return llm, [logits for logits, _ in llm.engine.score(seqs)]


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_gguf_blocks_load_exactly(smollm2, scheme):
    seqs, ref, _ = smollm2
    llm, out = _score(None, seqs, quantization=scheme)
    from deepinfer.quant.linear import QuantizedLinear

    bits = sorted({m.scheme for m in llm.engine.runner.model.modules() if isinstance(m, QuantizedLinear)})
    assert bits == (["int8"] if scheme == "int8" else ["int4", "int8"])  # Q8_0 LM head stays int8
    for r, q in zip(ref, out):
        assert torch.equal(r, q)


@pytest.mark.parametrize("scheme,min_agreement", [("int8", 0.99), ("int4", 0.85)])
def test_quantized_from_float_argmax_agreement(smollm2, scheme, min_agreement):
    seqs, ref, float_copy = smollm2
    _, out = _score(str(float_copy), seqs, quantization=scheme)
    r = compare([x[:-1] for x in ref], [x[:-1] for x in out], seqs, 0)
    print(f"\nSmolLM2 {scheme} from float, teacher-forced over {r['positions']} positions: argmax "
          f"agreement {r['argmax_agreement']:.4f}, perplexity {r['ppl_reference']:.4f} -> "
          f"{r['ppl_tier']:.4f} ({r['ppl_change']:+.2%})")
    assert r["positions"] >= 300
    assert r["argmax_agreement"] >= min_agreement


@pytest.mark.parametrize("scheme,kernel,min_agreement", [
    ("int8", "native", 0.99), ("int4", "native", 0.99), ("int4", "native-float", 0.99), ("int4", "native-int8", 0.95)])
def test_native_kernel_on_the_gguf_blocks_matches_float(smollm2, scheme, kernel, min_agreement):
    """Calls of up to ``NATIVE_MAX_ROWS`` rows (decode, batched decode) run the native kernel: on
    the GGUF's own blocks, ``native-float``'s logits are the float model's up to fp32 rounding;
    ``native`` rounds the activations to int16 per block of 32 and must keep the argmax at the
    99% bar (teacher-forced, so the error is that of one step); ``native-int8`` (int8 blocks)
    falls below it, which is why it is opt-in."""
    from deepinfer.llm import LLM
    from deepinfer.quant.linear import NATIVE_MAX_ROWS

    seqs, ref, _ = smollm2
    llm = LLM(None, **ENGINE, quantization=scheme, quantization_kernel=kernel)
    if llm.engine.runner.quant_plan.kernel != kernel:
        pytest.skip(llm.engine.runner.quant_plan.note)
    n = NATIVE_MAX_ROWS - 28  # one forward of n rows per sequence
    outs = [llm.engine.score([seq[:n]])[0][0] for seq in seqs]
    refs = [r[:n] for r in ref]
    r = compare([x[:-1] for x in refs], [x[:-1] for x in outs], [s[:n] for s in seqs], 0)
    print(f"\nSmolLM2 GGUF {scheme}, {kernel} kernel vs the same weights in float, teacher-forced over "
          f"{r['positions']} positions: argmax agreement {r['argmax_agreement']:.4f}, perplexity "
          f"{r['ppl_reference']:.4f} -> {r['ppl_tier']:.4f} ({r['ppl_change']:+.2%})")
    assert r["argmax_agreement"] >= min_agreement
    if kernel == "native-float":
        for out, want in zip(outs, refs):
            assert (out - want).abs().max() <= 1e-3 * want.abs().max()
