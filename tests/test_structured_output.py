"""Structured output (SamplingParams.structured_outputs, through xgrammar) on the embedded model: JSON schemas,
regular expressions, choices and grammars give output that satisfies them, at temperature 0.8, with and without
async scheduling (where a step's bitmask waits for the step before), through preemption, beside unconstrained
requests; a constraint the greedy output already satisfies changes no token; one that does not compile is
refused with a message that says so."""

from __future__ import annotations

import json
import re

import pytest

from tests.utils import USER_SCHEMA as SCHEMA
from tinyvllm import LLM, SamplingParams, StructuredOutputsParams
from tinyvllm.engine.input_processor import InputError

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.slow

PROMPT = "Describe a user of a web service as a JSON object."


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_kv_blocks=512, max_num_seqs=16)


def _constrained(**kind: object) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kind)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_json_schema_regex_and_choice_hold(async_scheduling: bool) -> None:
    """6 requests with a JSON schema (nested object, enum, array, required fields), 3 with a regex, 3 with a
    choice and 2 unconstrained, together at temperature 0.8."""
    llm = LLM(num_kv_blocks=512, max_num_seqs=16, async_scheduling=async_scheduling)
    json_params = [SamplingParams(temperature=0.8, seed=i, max_tokens=160,
                                  structured_outputs=_constrained(json=SCHEMA)) for i in range(6)]
    regex = r"[A-Z][a-z]{2,8}, [0-9]{2} years"
    regex_params = [SamplingParams(temperature=0.8, seed=i, max_tokens=20, structured_outputs=_constrained(regex=regex))
                    for i in range(3)]
    choices = ["yes", "no", "maybe later"]
    choice_params = [SamplingParams(temperature=0.8, seed=i, max_tokens=10,
                                    structured_outputs=_constrained(choice=choices)) for i in range(3)]
    free = [SamplingParams(temperature=0.8, seed=i, max_tokens=12, ignore_eos=True) for i in range(2)]
    prompts = [PROMPT] * 6 + ["Name and age of a person:"] * 3 + ["Will it rain tomorrow? Answer:"] * 3 + ["Hi"] * 2
    outputs = llm.generate(prompts, json_params + regex_params + choice_params + free, use_tqdm=False)
    for output in outputs[:6]:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion
        jsonschema.validate(json.loads(completion.text), SCHEMA)
    for output in outputs[6:9]:
        assert re.fullmatch(regex, output.outputs[0].text), output.outputs[0].text
    for output in outputs[9:12]:
        assert output.outputs[0].text in choices
    assert all(len(o.outputs[0].token_ids) == 12 for o in outputs[12:])


def test_satisfied_constraint_changes_no_token(llm: LLM) -> None:
    """Greedy: a regex the unconstrained output already matches, and a choice that holds it, give its tokens."""
    prompt = "The capital of France is"
    (free,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    text = free.outputs[0].text
    for constraint in (_constrained(regex=r"(.|\n)*"), _constrained(choice=[text, "Berlin"])):
        (bound,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, structured_outputs=constraint),
                                use_tqdm=False)
        assert bound.outputs[0].token_ids[:len(free.outputs[0].token_ids)] == free.outputs[0].token_ids


def test_logprobs_are_the_models_own_under_a_grammar(llm: LLM) -> None:
    """A token's logprobs are those of the model's distribution before the grammar's mask (as before penalties): a
    choice that forbids the model's favourite first token draws another, ranked below it, and the top ones are the
    unconstrained run's."""
    prompt = "The capital of France is"
    (free,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=3), use_tqdm=False)
    (bound,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=3,
                                                     structured_outputs=_constrained(choice=["zzz"])), use_tqdm=False)
    (favourite,) = free.outputs[0].token_ids
    (drawn,) = bound.outputs[0].token_ids
    assert drawn != favourite and bound.outputs[0].logprobs[0][drawn].rank > 1

    def top(entry: dict) -> list[tuple[int, int]]:
        return sorted((lp.rank, token) for token, lp in entry.items() if lp.rank <= 3)

    assert top(bound.outputs[0].logprobs[0]) == top(free.outputs[0].logprobs[0])


def test_preempted_constrained_requests_stay_valid() -> None:
    """A KV pool too small for all of them at once: requests are preempted and recomputed, their grammars keep
    their place (the tokens they had are theirs), and every output still validates."""
    llm = LLM(num_kv_blocks=10, block_size=16, max_num_seqs=4)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=80, structured_outputs=_constrained(json=SCHEMA))
              for i in range(4)]
    outputs = llm.generate([PROMPT] * 4, params, use_tqdm=False)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    for output in outputs:
        if output.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(output.outputs[0].text), SCHEMA)
        else:  # (cut by max_tokens: a prefix of valid JSON)
            assert output.outputs[0].finish_reason == "length"


def test_json_object_and_grammar(llm: LLM) -> None:
    (obj,) = llm.generate([PROMPT], SamplingParams(temperature=0.8, seed=4, max_tokens=100,
                                                   structured_outputs=_constrained(json_object=True)), use_tqdm=False)
    assert obj.outputs[0].finish_reason == "stop" and isinstance(json.loads(obj.outputs[0].text), dict)
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    (ebnf,) = llm.generate(["Q: Is the sky blue?"], SamplingParams(
        temperature=0.8, seed=4, max_tokens=20, structured_outputs=_constrained(grammar=grammar)), use_tqdm=False)
    assert ebnf.outputs[0].text in ("The answer is yes.", "The answer is no.")


def test_constraints_that_do_not_compile_are_refused(llm: LLM) -> None:
    for constraint, what in ((_constrained(regex="(unclosed"), "regex"),
                             (_constrained(grammar="root ::= missing_rule"), "grammar"),
                             (_constrained(json='{"type": "object", "properties": 3}'), "json")):
        with pytest.raises(InputError, match=f"structured_outputs.{what} does not compile") as caught:
            llm.generate(["Hi"], SamplingParams(structured_outputs=constraint), use_tqdm=False)
        assert caught.value.param == "structured_outputs"
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="min_tokens cannot be used with structured_outputs"):
        SamplingParams(min_tokens=4, structured_outputs=_constrained(choice=["yes", "no"]))  # (it could force a token
        # the grammar forbids: at its end it allows only EOS, which min_tokens masks)
    (ok,) = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)  # (still serving)
    assert len(ok.outputs[0].token_ids) == 3


def test_speculation_under_a_grammar() -> None:
    """n-gram proposals for constrained sequences: only those the grammar allows are scheduled, each verified
    position under its own bitmask row, so greedy output is the one without speculation (float32, a request at a
    time: in a batch, a verification's several rows change the step's arithmetic, and the embedded model's digits
    are near-ties), and sampled output still validates."""
    speculative = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    plain = LLM(dtype="float32", num_kv_blocks=512, max_num_seqs=8)
    spec = LLM(dtype="float32", num_kv_blocks=512, max_num_seqs=8, speculative_config=speculative)
    regex = r"(keeper|guardian)( (keeper|guardian)){5,30}"
    cases = [(f"Repeat after me: {' '.join(['keeper guardian'] * 12)}\n",
              SamplingParams(temperature=0, max_tokens=60, structured_outputs=_constrained(regex=regex))),
             (PROMPT, SamplingParams(temperature=0, max_tokens=100, structured_outputs=_constrained(json=SCHEMA)))]
    greedy = []
    for prompt, params in cases:
        (expected,) = plain.generate([prompt], params, use_tqdm=False)
        (output,) = spec.generate([prompt], params, use_tqdm=False)
        assert output.outputs[0].token_ids == expected.outputs[0].token_ids
        greedy.append(output.outputs[0])
    assert re.fullmatch(regex, greedy[0].text)
    if greedy[1].finish_reason == "stop":
        jsonschema.validate(json.loads(greedy[1].text), SCHEMA)
    assert spec.llm_engine.get_stats()["spec_decode_num_accepted_tokens"] > 0
    sampled = [SamplingParams(temperature=0.8, seed=i, max_tokens=160, structured_outputs=_constrained(json=SCHEMA))
               for i in range(2)] + [SamplingParams(temperature=0.8, seed=9, max_tokens=60,
                                                    structured_outputs=_constrained(regex=regex))]
    outputs = spec.generate([PROMPT] * 2 + [cases[0][0]], sampled, use_tqdm=False)
    for output in outputs[:2]:
        if output.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(output.outputs[0].text), SCHEMA)
    assert re.fullmatch(regex, outputs[2].outputs[0].text)
