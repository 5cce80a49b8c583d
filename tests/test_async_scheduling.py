"""Async scheduling (step N+1 scheduled and launched before step N's tokens are read back) gives exactly
the outputs of the synchronous engine: greedy and seeded sampling, early stops at a pending token,
preemption, chunked prefill, static batching, prefix caching, n > 1, aborts, penalties, stop strings."""

import random

import pytest

from tests.utils import tiny_llama_fixture, tiny_llm
from tinyvllm import LLM, SamplingParams

checkpoint = tiny_llama_fixture(seed=9)


@pytest.fixture(scope="module")
def workload():
    """Ragged prompts; greedy and seeded requests; lengths from 1 token up; frequent stop tokens so that
    many sequences stop early, while a token for them is already pending."""
    rng = random.Random(4)
    prompts = [[rng.randrange(2, 256) for _ in range(rng.randint(1, 70))] for _ in range(16)]
    stops = list(range(2, 14))
    params = []
    for i in range(16):
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(temperature=0, max_tokens=rng.randint(1, 30), ignore_eos=True))
        elif kind == 1:
            params.append(SamplingParams(temperature=0, max_tokens=30, stop_token_ids=stops))
        elif kind == 2:
            params.append(SamplingParams(temperature=0.9, top_k=20, seed=i, max_tokens=25, stop_token_ids=stops,
                                         min_tokens=3))
        else:
            params.append(SamplingParams(temperature=1.1, top_p=0.8, seed=i, max_tokens=20, logprobs=2))
    return prompts, params


def summary(outputs):
    """Tokens, finish and stop reasons exactly; logprobs to 1e-4 (the batches differ in shape between the
    two modes, so float32 sums may round differently)."""
    return [[(c.token_ids, c.finish_reason, c.stop_reason,
              None if c.logprobs is None else [sorted((t, pytest.approx(lp.logprob, abs=1e-4))
                                                      for t, lp in step.items()) for step in c.logprobs])
             for c in o.outputs] for o in outputs]


def generate(checkpoint, prompts, params, async_scheduling, overlaps=None, **kwargs):
    """Outputs and engine; checks the pool is whole and whether steps overlapped (default: iff async)."""
    llm = tiny_llm(checkpoint, async_scheduling=async_scheduling, **kwargs)
    engine = llm.llm_engine
    overlapped_steps = []
    engine.add_step_callback(lambda stats: overlapped_steps.append(stats.num_inputs_in_flight > 0))
    outputs = llm.generate(prompts, params, use_tqdm=False)
    engine.engine_core.block_manager.check_whole()
    assert not engine.engine_core.scheduler.running and not engine.engine_core.scheduler.waiting
    # With async scheduling most steps take some input token from the step still in flight.
    overlaps = async_scheduling if overlaps is None else overlaps
    assert (sum(overlapped_steps) > len(overlapped_steps) // 2) == overlaps
    return summary(outputs), engine


CONFIGS = {
    "plenty": dict(num_kv_blocks=256),
    "no_prefix_caching": dict(num_kv_blocks=256, enable_prefix_caching=False),
    "chunked": dict(num_kv_blocks=256, max_num_batched_tokens=16),
    "preempting": dict(num_kv_blocks=20, max_num_batched_tokens=32),
    "static": dict(num_kv_blocks=256, scheduling="static", max_num_seqs=5),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_async_equals_sync(checkpoint, workload, config):
    prompts, params = workload
    sync, _ = generate(checkpoint, prompts, params, False, **CONFIGS[config])
    overlapped, engine = generate(checkpoint, prompts, params, True, **CONFIGS[config])
    assert overlapped == sync
    if config == "preempting":
        assert engine.engine_core.scheduler.num_preemptions >= 1


def test_n_and_shared_prefixes(checkpoint):
    system = list(range(20, 60))
    prompts = [system + [i, i + 1] for i in range(6)]
    params = SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=12, stop_token_ids=[5, 6, 7])
    sync, _ = generate(checkpoint, prompts, params, False, num_kv_blocks=64)
    overlapped, _ = generate(checkpoint, prompts, params, True, num_kv_blocks=64)
    assert overlapped == sync


def test_penalties_are_not_overlapped_but_still_right(checkpoint, workload):
    prompts, _ = workload
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.5,
                            frequency_penalty=0.5, presence_penalty=0.3)
    sync, _ = generate(checkpoint, prompts[:6], params, False, num_kv_blocks=128)
    overlapped, _ = generate(checkpoint, prompts[:6], params, True, overlaps=False, num_kv_blocks=128)
    assert overlapped == sync


def test_abort_while_a_step_is_in_flight(checkpoint, workload):
    prompts, _ = workload
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected, _ = generate(checkpoint, prompts[:4], params, False, num_kv_blocks=128)
    llm = tiny_llm(checkpoint, async_scheduling=True, num_kv_blocks=128)
    engine = llm.llm_engine
    for i, p in enumerate(prompts[:4]):
        engine.add_request(str(i), p, params, output_kind="final_only")
    engine.add_request("doomed", prompts[5], params)
    finals = {}
    for step in range(200):
        if step == 4:
            assert engine.engine_core.has_step_in_flight  # the abort lands while a step is on the device
            assert engine.abort_request("doomed")
        for out in engine.step():
            assert out.request_id != "doomed" or step < 4
            if out.finished:
                finals[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    engine.step()  # drains what was still in flight: nothing to report
    assert summary([finals[str(i)] for i in range(4)]) == expected
    engine.engine_core.block_manager.check_whole()


def test_streamed_deltas_add_up(checkpoint, workload):
    prompts, params = workload
    llm = tiny_llm(checkpoint, async_scheduling=True, num_kv_blocks=256)
    engine = llm.llm_engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp, output_kind="delta")
    streamed: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    final, _ = generate(checkpoint, prompts, params, False, num_kv_blocks=256)
    assert [streamed[str(i)] for i in range(len(prompts))] == [f[0][0] for f in final]


def test_stop_strings_with_async_scheduling(tiny_text_checkpoint):
    prompts = ["The cat sat on", "One two three four", "Hello there, general"]
    params = SamplingParams(temperature=0, max_tokens=24, stop=[" the", "e"], include_stop_str_in_output=False)
    results = []
    for flag in (False, True):
        llm = LLM(tiny_text_checkpoint, device="cpu", num_kv_blocks=128, async_scheduling=flag)
        results.append([(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason)
                        for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.llm_engine.engine_core.block_manager.check_whole()
    assert results[0] == results[1]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_model_runner_rows_of_finished_sequences_are_reused(checkpoint, async_scheduling):
    """Each running sequence holds a row of the model runner's persistent arrays, handed back when it is
    freed. Here one request finishes a step before the other's last token is pending, so that with async
    scheduling the next batch is empty: the freed row must still come back (with the batch after)."""
    llm = tiny_llm(checkpoint, async_scheduling=async_scheduling, num_kv_blocks=256, max_num_seqs=4)
    batch = llm.llm_engine.engine_core.model_runner.input_batch
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 4)]
    for _ in range(6):
        llm.generate([[5, 6, 7], [8, 9, 10, 11]], params, use_tqdm=False)
        assert len(batch.row_of) <= 2  # this round's, until the next round's first batch hands them back
    assert batch.capacity == 2 * 4
