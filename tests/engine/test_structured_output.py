"""Structured output on the real model: every seeded sample of a JSON schema, regex, choice or
grammar request follows it; a cut-off one says "length"; free requests batched beside
constrained ones get the tokens they get alone; bad constraints are 400-style InputErrors."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from kvmemo import SamplingParams
from kvmemo.errors import InputError
from kvmemo.structured import StructuredOutputsParams as Structured

pytestmark = pytest.mark.model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "pets": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "pets", "employed"],
}


def _texts(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def test_twenty_seeded_json_schema_samples_are_all_valid_instances(llm):
    params = [
        SamplingParams(max_tokens=120, temperature=1.0, seed=s,
                       structured_outputs=Structured(json=PERSON))
        for s in range(20)
    ]
    outs = _texts(llm, ["Describe a person as JSON."] * 20, params)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)
    assert len({o.text for o in outs}) > 10  # sampled, not one forced string
    # The properties come in the schema's order.
    assert all(list(json.loads(o.text)) == list(PERSON["properties"]) for o in outs)


def test_regex_and_choice_are_always_met(llm):
    pattern = r"[A-Z]{2}-\d{3}( ok| no)?"
    regex = [SamplingParams(max_tokens=20, temperature=1.2, seed=s,
                            structured_outputs=Structured(regex=pattern)) for s in range(10)]
    choices = ["yes", "no", "it depends", 'say "maybe"']
    choice = [SamplingParams(max_tokens=20, temperature=1.2, seed=s,
                             structured_outputs=Structured(choice=choices)) for s in range(10)]
    outs = _texts(llm, ["Write a code."] * 10 + ["Is water wet?"] * 10, regex + choice)
    for out in outs[:10]:
        assert re.fullmatch(pattern, out.text), out.text
    for out in outs[10:]:
        assert out.text in choices and out.finish_reason == "stop"
    assert len({o.text for o in outs[:10]}) > 1


def test_grammar_and_json_object(llm):
    grammar = 'root ::= "(" num " " op " " num ")"\nnum ::= [1-9] [0-9]?\nop ::= "+" | "*"'
    params = [
        SamplingParams(max_tokens=30, temperature=1.0, seed=s,
                       structured_outputs=Structured(grammar=grammar)) for s in range(5)
    ] + [
        SamplingParams(max_tokens=60, temperature=0.7, seed=s,
                       structured_outputs=Structured(json_object=True)) for s in range(5)
    ]
    outs = _texts(llm, ["An arithmetic expression:"] * 5 + ["Some JSON:"] * 5, params)
    for out in outs[:5]:
        assert re.fullmatch(r"\([1-9][0-9]? [+*] [1-9][0-9]?\)", out.text), out.text
    for out in outs[5:]:
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict), out.text
        else:
            assert out.finish_reason == "length" and out.text.startswith("{")


def test_cut_off_output_says_length(llm):
    params = SamplingParams(max_tokens=4, temperature=0.0,
                            structured_outputs=Structured(json=PERSON))
    out = _texts(llm, ["Describe a person as JSON."], params)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert out.text.startswith('{"name": "')


def test_free_requests_get_the_same_tokens_beside_constrained_ones(llm):
    free = [
        SamplingParams(max_tokens=16, temperature=0.0),
        SamplingParams(max_tokens=16, temperature=0.9, seed=7),
        SamplingParams(max_tokens=16, temperature=0.8, seed=11, repetition_penalty=1.3),
    ]
    prompts = ["The capital of France is", "Once upon a time", "List three fruits:"]
    alone = [o.token_ids for o in _texts(llm, prompts, free)]
    constrained = [
        SamplingParams(max_tokens=16, temperature=1.0, seed=3,
                       structured_outputs=Structured(json=PERSON)),
        SamplingParams(max_tokens=16, temperature=0.0,
                       structured_outputs=Structured(choice=["red", "blue"])),
    ]
    mixed = _texts(llm, ["Person:", *prompts, "Colour:"],
                   [constrained[0], *free, constrained[1]])
    assert [o.token_ids for o in mixed[1:4]] == alone
    assert mixed[4].text in ("red", "blue")


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (dict(json={"type": "nonsense"}), "invalid json"),
        (dict(regex="(ab"), "invalid regex"),
        (dict(grammar="root ::= undefined_rule"), "invalid grammar"),
    ],
)
def test_bad_constraint_is_an_input_error_and_the_engine_goes_on(llm, spec, words):
    with pytest.raises(InputError, match=words) as info:
        llm.generate(["hi"], SamplingParams(max_tokens=2, structured_outputs=Structured(**spec)),
                     use_tqdm=False)
    assert info.value.param == "structured_outputs"
    assert len(_texts(llm, ["hi"], SamplingParams(max_tokens=2))[0].token_ids) == 2


def test_compiled_grammars_are_cached_by_spec(llm):
    compiler = llm.engine._structured_compiler()
    schema = {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}
    before = (compiler.num_compiled, compiler.num_cache_hits)
    for text in (schema, json.dumps(schema, indent=2)):  # the same schema, other whitespace
        _texts(llm, ["x"], SamplingParams(max_tokens=8, structured_outputs=Structured(json=text)))
    assert (compiler.num_compiled, compiler.num_cache_hits) == (before[0] + 1, before[1] + 1)


@pytest.mark.parametrize(
    "fields",
    [{}, {"regex": "a", "choice": ["a"]}, {"choice": []}, {"choice": ["a", ""]},
     {"json": "{not json"}, {"regex": ""}],
)
def test_params_need_exactly_one_well_typed_constraint(fields):
    with pytest.raises(InputError) as info:
        Structured(**fields)
    assert info.value.param == "structured_outputs"


def test_sampler_masks_only_constrained_rows(llm):
    """A direct check of the mask: the constrained row's allowed set is exactly the grammar's
    next tokens (computed here by asking the tokenizer), the free row is untouched."""
    from kvmemo.engine.sampler import _masked_by_grammar

    tokenizer = llm.engine.tokenizer
    constraint = llm.engine._structured_compiler().constraint(Structured(choice=["yes", "no"]))
    logits = torch.randn(2, llm.engine.processor.vocab_size)
    masked = _masked_by_grammar(logits, [constraint, None])
    torch.testing.assert_close(masked[1], logits[1], rtol=0, atol=0)
    allowed = torch.isfinite(masked[0]).nonzero().flatten().tolist()
    texts = [tokenizer.decode([t]) for t in allowed]
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    assert tokenizer.encode("yes", add_special_tokens=False)[0] in allowed
