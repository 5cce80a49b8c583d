"""Continuous batching, static batching, chunked prefill and preemption all give each request the
greedy output it gets alone, and leave the KV pool whole."""

import random

import pytest

from tests.utils import tiny_llama_fixture, tiny_llm
from tinyvllm import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


checkpoint = tiny_llama_fixture(seed=3)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    return [[rng.randrange(2, 256) for _ in range(rng.randint(1, 90))] for _ in range(20)]


@pytest.fixture(scope="module")
def alone(checkpoint, prompts):
    llm = tiny_llm(checkpoint, num_kv_blocks=64)
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def run(checkpoint, prompts, **kwargs):
    llm = tiny_llm(checkpoint, **kwargs)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    engine = llm.llm_engine
    engine.engine_core.block_manager.check_whole()
    assert not engine.engine_core.scheduler.running and not engine.engine_core.scheduler.waiting
    return [o.outputs[0].token_ids for o in outputs], engine


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_continuous_batching_equals_alone(checkpoint, prompts, alone, prefix_caching):
    outputs, engine = run(checkpoint, prompts, num_kv_blocks=256, enable_prefix_caching=prefix_caching)
    assert outputs == alone


def test_static_batching_equals_alone(checkpoint, prompts, alone):
    outputs, _ = run(checkpoint, prompts, num_kv_blocks=256, scheduling="static", max_num_seqs=8)
    assert outputs == alone


def test_chunked_prefill_equals_alone(checkpoint, prompts, alone):
    # A budget of 16 tokens per step: every prompt over 16 tokens is prefilled in chunks, mixed with decodes.
    outputs, engine = run(checkpoint, prompts, num_kv_blocks=256, max_num_batched_tokens=16)
    assert outputs == alone


def test_kv_exhaustion_preempts_and_recomputes(checkpoint, prompts, alone):
    # 24 blocks of 16 tokens hold ~3 of these requests at once; 20 are submitted together.
    outputs, engine = run(checkpoint, prompts, num_kv_blocks=24, enable_prefix_caching=False)
    assert engine.engine_core.scheduler.num_preemptions >= 1
    assert outputs == alone


def test_kv_exhaustion_with_prefix_caching(checkpoint, prompts, alone):
    outputs, engine = run(checkpoint, prompts, num_kv_blocks=24, max_num_batched_tokens=32)
    assert engine.engine_core.scheduler.num_preemptions >= 1
    assert outputs == alone


def test_static_waits_for_the_whole_batch(checkpoint, prompts):
    llm = tiny_llm(checkpoint, num_kv_blocks=256, scheduling="static", max_num_seqs=4)
    engine = llm.llm_engine
    for i, p in enumerate(prompts[:8]):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=4 + 4 * i, ignore_eos=True))
    admitted_while_running = False
    while engine.has_unfinished_requests():
        running_before = {s.request_id for s in engine.engine_core.scheduler.running}
        engine.step()
        running_after = {s.request_id for s in engine.engine_core.scheduler.running}
        if running_before and running_after - running_before:
            admitted_while_running = True
    assert not admitted_while_running
