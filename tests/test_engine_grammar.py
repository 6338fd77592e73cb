"""Constrained decoding in the CPU engine (issue 42): SGLang 0.5.23's ``sampling_params`` grammars (json_schema,
regex, ebnf, structural_tag), compiled by xgrammar as SGLang's default backend does, applied as a token mask at
every step, batched with unconstrained requests, refused with a clear 400 where they cannot be honoured."""

from __future__ import annotations

import json
import math
import re

import httpx
import pytest

from slime_server.rollout.cpu_engine import BadRequest, CPUEngine, EngineConfig
from slime_server.rollout.engine_sequence import Sequence
from slime_server.rollout.protocol import SamplingParams

PROMPT = [31, 32, 33, 34]
# bounded everywhere (enums, integer ranges, maxItems), so a sample always finishes within its token budget
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Lima", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "ok": {"type": "boolean"},
        "plan": {"type": "object", "properties": {"mode": {"enum": ["bus", "train"]},
                                                  "stops": {"type": "array", "items": {"type": "integer",
                                                                                       "minimum": 0, "maximum": 9},
                                                            "maxItems": 3}},
                 "required": ["mode", "stops"], "additionalProperties": False},
    },
    "required": ["city", "days", "ok", "plan"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    eng = CPUEngine(EngineConfig(model_path=str(tiny_model_path), max_running_requests=16,
                                 constrained_json_max_whitespace_cnt=2))
    yield eng
    eng.shutdown()


def _valid(doc: object, schema: dict) -> bool:
    import jsonschema

    return jsonschema.Draft202012Validator(schema).is_valid(doc)


def test_json_schema_samples_parse_and_validate(engine: CPUEngine) -> None:
    """Sampled at temperature 1 from a model that knows no JSON, every answer is JSON that validates."""
    outs = engine.generate(PROMPT, SamplingParams(temperature=1.0, max_new_tokens=400, n=32, sampling_seed=7,
                                                  json_schema=json.dumps(SCHEMA)))
    for o in outs:
        assert o.meta_info.finish_reason.type == "stop", o.text  # the grammar ended it, not the token budget
        assert _valid(json.loads(o.text), SCHEMA), o.text
    assert len({o.text for o in outs}) > 8  # sampled, not one forced answer


def test_any_json_regex_and_ebnf(engine: CPUEngine) -> None:
    outs = engine.generate(PROMPT, SamplingParams(temperature=1.0, max_new_tokens=300, n=8, sampling_seed=3,
                                                  json_schema="$$ANY$$"))
    for o in outs:  # any JSON value (what SGLang's OpenAI routes send for response_format json_object)
        if o.meta_info.finish_reason.type == "stop":
            json.loads(o.text)
    pattern = r"(yes|no), [0-9]{2}"
    for o in engine.generate(PROMPT, SamplingParams(temperature=1.0, max_new_tokens=50, n=8, sampling_seed=1,
                                                    regex=pattern)):
        assert re.fullmatch(pattern, o.text), o.text
    ebnf = 'root ::= "The answer is " ("A" | "B" | "C") "."'
    for o in engine.generate(PROMPT, SamplingParams(temperature=1.0, max_new_tokens=50, n=8, sampling_seed=1,
                                                    ebnf=ebnf)):
        assert re.fullmatch(r"The answer is [ABC]\.", o.text), o.text


def test_constrained_log_probs_are_the_masked_distribution(engine: CPUEngine) -> None:
    """The recorded log-prob is that of the masked, renormalised distribution the token was drawn from: the
    allowed tokens' probabilities sum to one, and no forbidden token has any."""
    (o,) = engine.generate(PROMPT, SamplingParams(temperature=1.0, max_new_tokens=4, sampling_seed=0,
                                                  regex="(ab|cd|ef)"),
                           return_logprob=True, top_logprobs_num=50)
    first_top = o.meta_info.output_top_logprobs[0]
    allowed = [(lp, tok) for lp, tok, _ in first_top if lp is not None and math.isfinite(lp)]
    assert 1 <= len(allowed) < 50
    assert abs(sum(math.exp(lp) for lp, _ in allowed) - 1.0) < 1e-4
    for _, tok in allowed:
        assert engine.tokenizer.decode([tok]) in ("a", "ab", "c", "cd", "e", "ef")
    chosen = o.meta_info.output_token_logprobs[0]
    assert chosen[1] in [t for _, t in allowed] and chosen[0] == next(lp for lp, t in allowed if t == chosen[1])


def test_unconstrained_requests_are_unchanged_beside_constrained_ones(engine: CPUEngine) -> None:
    """One decode batch with and without grammars: the unconstrained greedy samples equal a run without the
    others (the mask touches only the constrained rows)."""
    plain = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    alone = [engine.generate(p, plain)[0].output_ids for p in (PROMPT, [41, 42, 43])]
    engine.pause("in_place")  # queue everything, then admit it in one step
    seqs: list[Sequence] = []
    try:
        for p in (PROMPT, [41, 42, 43]):
            seqs += engine.new_sequences(p, plain)
        seqs += engine.new_sequences(PROMPT, SamplingParams(temperature=1.0, max_new_tokens=60, n=3,
                                                            sampling_seed=5, json_schema=json.dumps(SCHEMA)))
        seqs += engine.new_sequences([41, 42, 43], SamplingParams(temperature=0, max_new_tokens=20,
                                                                  regex="[0-9]{20}"))
        engine.attach_grammars(seqs)
        for s in seqs:
            engine.submit(s)
    finally:
        engine.resume()
    for s in seqs:
        assert s.done.wait(120)
    assert [s.output_ids for s in seqs[:2]] == alone
    assert re.fullmatch("[0-9]{20}", engine.tokenizer.decode(seqs[-1].output_ids))


@pytest.mark.parametrize(("params", "why"), [
    ({"regex": "(ab"}, "Failed to compile regex grammar: Regex parsing error"),
    ({"json_schema": '{"type": 5}'}, "Failed to compile json grammar"),
    ({"json_schema": "{not json"}, "Failed to compile json grammar"),
    ({"json_schema": '{"type": "integer", "multipleOf": 3}'}, "'multipleOf'"),
    ({"json_schema": '{"type": "array", "uniqueItems": true}'}, "'uniqueItems'"),
    ({"ebnf": "root ::= "}, "Failed to compile ebnf grammar: EBNF parser error"),
])
def test_a_grammar_that_cannot_be_honoured_is_refused(engine: CPUEngine, params: dict, why: str) -> None:
    with pytest.raises(BadRequest, match=re.escape(why)):
        engine.generate(PROMPT, SamplingParams(max_new_tokens=4, **params))


def test_only_one_grammar_and_none_backend(tiny_model_path) -> None:
    with pytest.raises(ValueError, match="Only one of json_schema, regex, ebnf, or structural_tag can be set"):
        SamplingParams(regex="a", ebnf='root ::= "a"')
    eng = CPUEngine(EngineConfig(model_path=str(tiny_model_path), grammar_backend="none"))
    try:
        with pytest.raises(BadRequest, match="--grammar-backend none"):
            eng.generate(PROMPT, SamplingParams(max_new_tokens=4, regex="a"))
        assert eng.generate(PROMPT, SamplingParams(max_new_tokens=4))[0].output_ids  # no grammar: served
    finally:
        eng.shutdown()


def test_http_generate_refuses_a_bad_grammar_with_sglangs_error(tiny_model_path, tmp_path) -> None:
    from tests._engine_helpers import engine_process

    with engine_process(tiny_model_path, tmp_path) as url:
        r = httpx.post(f"{url}/generate", json={"input_ids": PROMPT, "sampling_params": {"regex": "(ab"}},
                       timeout=60)
        assert r.status_code == 400 and "Failed to compile regex grammar" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/generate", json={"input_ids": PROMPT, "sampling_params": {
            "regex": "[0-9]{6}", "max_new_tokens": 10, "temperature": 1.0}}, timeout=60)
        assert r.status_code == 200 and re.fullmatch("[0-9]{6}", r.json()["text"]), r.text
