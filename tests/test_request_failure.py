"""An error that reaches the engine core while it serves one request fails that request alone (issue: no single
request may kill the server). The model runner's test hook (TINYVLLM_TEST_FAIL_TOKEN) refuses any new sequence
holding a token id, as it would one whose state it could not take in: the engine core undoes that step, ends the
request with finish_reason "error", and every other request comes out exactly as it would have without it, with
the KV pool whole afterwards. Both with and without async scheduling, and with the bad request arriving while
the others decode (its step then carries them too, and a step may be in flight)."""

import random

import pytest

from tests.utils import tiny_llama_fixture, tiny_llm
from tinyvllm import SamplingParams
from tinyvllm.worker.model_runner import FAIL_TOKEN_VARIABLE

checkpoint = tiny_llama_fixture(seed=21)
FAIL_TOKEN = 255  # (the others' prompts never hold it)


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 250) for _ in range(rng.randint(3, 40))] for _ in range(count)]


def _params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=0.8, seed=i, max_tokens=12, ignore_eos=True)
    return SamplingParams(temperature=0, max_tokens=10 + i, ignore_eos=True)


def _run(engine, prompts, bad_after_steps: int | None, bad_n: int = 1) -> dict[str, list]:
    """Every request's final token lists (by completion), adding the bad request after that many steps."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, _params(i))
    finished: dict[str, list] = {}
    steps = 0
    while engine.has_unfinished_requests():
        if steps == bad_after_steps:
            engine.add_request("bad", [3, 4, FAIL_TOKEN, 5],
                               SamplingParams(temperature=0, max_tokens=8, n=bad_n, ignore_eos=True))
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = [(c.token_ids, c.finish_reason) for c in output.outputs]
        steps += 1
    return finished


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("bad_after_steps,bad_n", [(0, 1), (3, 2)])
def test_one_failing_request_leaves_the_others_alone(checkpoint, monkeypatch, async_scheduling, bad_after_steps,
                                                     bad_n):
    prompts = _prompts(6, seed=3)
    reference = _run(tiny_llm(checkpoint, num_kv_blocks=64, async_scheduling=async_scheduling).llm_engine, prompts,
                     None)
    monkeypatch.setenv(FAIL_TOKEN_VARIABLE, str(FAIL_TOKEN))
    llm = tiny_llm(checkpoint, num_kv_blocks=64, async_scheduling=async_scheduling)
    engine = llm.llm_engine
    outputs = _run(engine, prompts, bad_after_steps, bad_n)
    bad = outputs.pop("bad")
    assert bad == [([], "error")] * bad_n
    assert outputs == reference
    core = engine.engine_core
    core.block_manager.check_whole()
    assert not core.requests and not core.scheduler.running and not core.scheduler.waiting
    # and the engine serves on
    again = llm.generate([prompts[0]], _params(0), use_tqdm=False)
    assert [(c.token_ids, c.finish_reason) for c in again[0].outputs] == reference["0"]


def test_offline_generate_returns_the_failed_request(checkpoint, monkeypatch):
    """LLM.generate returns every prompt's output, the failed one with finish_reason "error"."""
    monkeypatch.setenv(FAIL_TOKEN_VARIABLE, str(FAIL_TOKEN))
    llm = tiny_llm(checkpoint, num_kv_blocks=64)
    outputs = llm.generate([[3, 4, 5], [3, FAIL_TOKEN], [6, 7]], SamplingParams(temperature=0, max_tokens=4),
                           use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", "error", "length"]
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 0, 4]
