"""Stop rules on a real request state, with a character tokenizer so the text is predictable."""

from deepinfer.request import Request
from deepinfer.sampling_params import SamplingParams
from deepinfer.stopping import StopRules

EOS = 0


class CharTokenizer:
    """Token i is the letter chr(ord('a') + i - 1); token 0 is the special EOS (skippable)."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join("" if i == EOS and skip_special_tokens else
                       "<eos>" if i == EOS else chr(ord("a") + i - 1) for i in ids)


def run(rules: StopRules, params: SamplingParams, tokens: list[int], prompt_len: int = 3):
    """Append ``tokens`` one at a time until a rule fires; the reason and the request."""
    req = Request("r", list(range(1, prompt_len + 1)), params)
    for t in tokens:
        req.output_token_ids.append(t)
        reason = rules.finish_reason(req)
        if reason is not None:
            return reason, req
    return None, req


def test_eos_and_stop_tokens_and_ignore_eos():
    rules = StopRules(CharTokenizer(), {EOS}, max_model_len=100)
    reason, req = run(rules, SamplingParams(max_tokens=10), [1, 2, EOS, 3])
    assert reason == "stop" and req.output_token_ids == [1, 2, EOS] and req.stop_reason == EOS
    reason, req = run(rules, SamplingParams(max_tokens=10, ignore_eos=True), [1, EOS, 3])
    assert reason is None and req.output_token_ids == [1, EOS, 3]
    reason, req = run(rules, SamplingParams(max_tokens=10, stop_token_ids=[3]), [1, 3, 2])
    assert reason == "stop" and req.stop_reason == 3 and req.output_token_ids == [1, 3]


def test_stop_string_is_cut_from_the_text():
    rules = StopRules(CharTokenizer(), {EOS}, max_model_len=100)
    # "abcde": the stop string "cd" ends in the 4th token
    reason, req = run(rules, SamplingParams(max_tokens=10, stop=["cd"]), [1, 2, 3, 4, 5])
    assert reason == "stop" and req.stop_reason == "cd" and req.output_token_ids == [1, 2, 3, 4]
    assert rules.output_text(req) == "ab"


def test_length_by_max_tokens_and_by_context():
    rules = StopRules(CharTokenizer(), {EOS}, max_model_len=6)
    reason, req = run(rules, SamplingParams(max_tokens=2), [1, 2, 3])
    assert reason == "length" and len(req.output_token_ids) == 2
    # 3 prompt tokens + 3 outputs reach the 6-token context first
    reason, req = run(rules, SamplingParams(max_tokens=50), [1, 2, 3, 4])
    assert reason == "length" and len(req.output_token_ids) == 3
    assert rules.output_text(req) == "abc"
