"""Grammar-constrained decoding holds even with random weights: outputs always parse and
validate; unconstrained requests in the same batch are untouched; bad specs name the field."""

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer.errors import RequestError
from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams
from deepinfer.structured import StructuredOutput

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 42, 99, 230, 64, 8]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), page_size=4, num_pages=512, progress=False,
               enable_disk_cache=False)


# ---------------------------------------------------------------- random bounded schemas
NAMES = st.text(alphabet="abcdefghij_", min_size=1, max_size=6)
LEAF = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.tuples(st.integers(-500, 500), st.integers(0, 900)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.integers(0, 6).flatmap(lambda hi: st.integers(0, hi).map(
        lambda lo: {"type": "string", "minLength": lo, "maxLength": hi})),
    st.lists(st.one_of(st.text(alphabet="xyz é", max_size=4), st.integers(-9, 9)),
             min_size=1, max_size=4, unique=True).map(lambda v: {"enum": v}),
)


def _array(items):
    return st.integers(0, 3).flatmap(lambda hi: st.integers(0, hi).map(
        lambda lo: {"type": "array", "items": items, "minItems": lo, "maxItems": hi}))


def _object(values):
    props = st.dictionaries(NAMES, values, min_size=1, max_size=4)
    return props.flatmap(lambda p: st.lists(st.sampled_from(sorted(p)), unique=True).map(
        lambda req: {"type": "object", "properties": p, "required": req,
                     "additionalProperties": False}))


SCHEMAS = _object(st.one_of(LEAF, LEAF.flatmap(_array), _object(LEAF)))


def max_bytes(schema: dict) -> int:
    """An upper bound on the compact JSON of any instance (a string char: at most a 6-byte
    escape); tokens are at least one byte each."""
    if "enum" in schema:
        return max(len(json.dumps(v).encode()) for v in schema["enum"])
    t = schema["type"]
    if t == "boolean" or t == "null":
        return 5
    if t == "integer":
        return max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    if t == "string":
        return 2 + 6 * schema["maxLength"]
    if t == "array":
        return 2 + schema["maxItems"] * (max_bytes(schema["items"]) + 1)
    return 2 + sum(len(json.dumps(k).encode()) + 2 + max_bytes(v)
                   for k, v in schema["properties"].items())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, seed=st.integers(0, 2**16))
def test_json_schema_outputs_always_parse_and_validate(llm, schema, seed):
    p = SamplingParams(max_tokens=max_bytes(schema) + 1, temperature=1.0, seed=seed,
                       structured_output=StructuredOutput.json_schema(schema))
    out = llm.generate(PROMPT, p)[0]
    assert out.finish_reason == "stop", (schema, out.text)
    jsonschema.validate(json.loads(out.text), schema)


def test_batched_constrained_rows_leave_the_others_alone(llm):
    schema = {"type": "object", "properties": {"k": {"enum": ["a", "b"]},
                                               "n": {"type": "integer", "minimum": 0,
                                                     "maximum": 50}},
              "required": ["k", "n"], "additionalProperties": False}
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = llm.generate([PROMPT, PROMPT[:4]], plain)
    eng = llm.engine
    reqs = [eng.add_request(PROMPT, plain),
            eng.add_request(PROMPT, SamplingParams(
                max_tokens=40, temperature=1.0, seed=3,
                structured_output=StructuredOutput.json_schema(schema))),
            eng.add_request(PROMPT[:4], plain)]
    outs = eng.run_to_completion(reqs)
    assert [outs[0].token_ids, outs[2].token_ids] == [a.token_ids for a in alone]
    jsonschema.validate(json.loads(outs[1].text), schema)


def test_json_object_regex_and_lark_with_embedded_json(llm):
    call = ('start: "<tool_call>" %json {"type": "object", "properties": {"x": {"type": '
            '"integer", "minimum": 0, "maximum": 9}}, "required": ["x"], '
            '"additionalProperties": false} "</tool_call>"')
    cases = [(StructuredOutput.json_object(), lambda t: isinstance(json.loads(t), dict)),
             (StructuredOutput.regex(r"[a-c]{3}-\d{2}"),
              lambda t: re.fullmatch(r"[a-c]{3}-\d{2}", t)),
             (StructuredOutput.lark('start: "yes" | "no"'), lambda t: t in ("yes", "no")),
             (StructuredOutput.lark(call), lambda t: t.startswith("<tool_call>") and
              t.endswith("</tool_call>") and
              0 <= json.loads(t[len("<tool_call>"):-len("</tool_call>")])["x"] <= 9)]
    # any JSON object has no length bound: a bias towards closing it ends it (and shows that
    # logit_bias and the mask compose)
    close = {llm.tokenizer.convert_tokens_to_ids(t): 8.0 for t in ('"', "}")}
    for so, check in cases:
        for seed in range(3):
            # ignore_eos: the finished grammar still ends the request
            out = llm.generate(PROMPT, SamplingParams(
                max_tokens=200, temperature=1.0, seed=seed, ignore_eos=True,
                structured_output=so, logit_bias=close if so.kind == "json_object" else {}))[0]
            assert out.finish_reason == "stop" and check(out.text), (so.kind, out.text)


@pytest.mark.parametrize("so,words", [
    (StructuredOutput.regex("(ab"), "regex"),
    (StructuredOutput.json_schema({"type": "nonsense"}), "nonsense"),
    (StructuredOutput.lark('start: "a'), "lark"),
    (StructuredOutput.lark('start: "a" undefined_rule'), "undefined_rule"),
])
def test_bad_specs_raise_request_error_naming_the_field(llm, so, words):
    with pytest.raises(RequestError) as e:
        llm.generate(PROMPT, SamplingParams(structured_output=so))
    assert e.value.field == "structured_output" and words in e.value.message
    assert llm.generate(PROMPT, SamplingParams(max_tokens=2))[0].token_ids  # still serving


def test_spec_shape_is_checked_when_built():
    with pytest.raises(RequestError, match="kind"):
        StructuredOutput("xml", "<a/>")
    with pytest.raises(RequestError, match="non-empty"):
        StructuredOutput.regex("")
    with pytest.raises(RequestError, match="object"):
        StructuredOutput.json_schema([1, 2])
