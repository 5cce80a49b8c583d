"""Prompt logprobs (SamplingParams.prompt_logprobs) equal transformers' log-softmax, under everything the engine
does to a prompt: chunked prefill, a prompt whose first blocks are in the prefix cache (the request computes them
again: cached blocks hold K/V, not logits), preemption and recomputation, async scheduling, several completions,
and batches that mix requests with and without them; and a sequence's prompt logprobs never hold a position twice
or leave one out."""

from __future__ import annotations

import pytest
import torch

from tests.utils import hf_model, tiny_llama_fixture, tiny_llm
from tinyvllm.sampling_params import MAX_LOGPROBS, SamplingParams

checkpoint = tiny_llama_fixture(seed=11)
TOP = 3
TOLERANCE = 1e-4


def _prompt(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(2, 256, (length,), generator=generator).tolist()


@pytest.fixture(scope="module")
def reference(checkpoint: str):
    """transformers' float32 log-softmax of a prompt's positions: [len - 1, vocab], row i scoring token i + 1."""
    model = hf_model(checkpoint)

    def logprobs(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)[:-1]

    return logprobs


def _check(prompt: list[int], got, expected: torch.Tensor, top: int = TOP) -> None:
    """Each entry: the prompt token's logprob and rank, then the top `top` by rank, as transformers has them."""
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for position in range(1, len(prompt)):
        row, token, entry = expected[position - 1], prompt[position], got[position]
        chosen = entry[token]
        assert abs(chosen.logprob - row[token].item()) < TOLERANCE, (position, chosen, row[token])
        assert chosen.rank == int((row > row[token]).sum()) + 1
        values, indices = row.topk(top)
        ranked = sorted(((lp.rank, t, lp.logprob) for t, lp in entry.items() if t != token or lp.rank <= top))
        assert [t for _, t, _ in ranked[:top]] == indices.tolist(), position
        assert max((abs(v - lp) for (_, _, lp), v in zip(ranked, values.tolist())), default=0.0) < TOLERANCE
        assert len(entry) in (top, top + 1)  # (the prompt token, and the top ones: it may be among them)


def test_chunked_prompt_equals_transformers(checkpoint: str, reference) -> None:
    """A 70-token prompt in chunks of 16 (the step's budget), beside a request without prompt logprobs."""
    llm = tiny_llm(checkpoint, num_kv_blocks=64, block_size=16, max_num_batched_tokens=16)
    prompt, other = _prompt(1, 70), _prompt(2, 30)
    scored, plain = llm.generate([prompt, other], [SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=TOP),
                                                   SamplingParams(temperature=0, max_tokens=4)], use_tqdm=False)
    _check(prompt, scored.prompt_logprobs, reference(prompt))
    assert plain.prompt_logprobs is None
    alone = tiny_llm(checkpoint, num_kv_blocks=64, block_size=16).generate(
        [prompt, other], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in alone] == [scored.outputs[0].token_ids, plain.outputs[0].token_ids]


def test_prefix_cache_hit_is_computed_again(checkpoint: str, reference) -> None:
    """The prompt's first blocks are in the prefix cache (an earlier request's): a request with prompt logprobs
    computes them again (num_cached_tokens 0) and its logprobs are right; one without still reads the cache."""
    llm = tiny_llm(checkpoint, num_kv_blocks=64, block_size=16, enable_prefix_caching=True)
    prefix = _prompt(3, 48)
    prompt = prefix + _prompt(4, 9)
    llm.generate([prefix + [7]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    (scored,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP),
                             use_tqdm=False)
    _check(prompt, scored.prompt_logprobs, reference(prompt))
    assert scored.num_cached_tokens == 0
    (plain,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert plain.num_cached_tokens == 48 and plain.outputs[0].token_ids == scored.outputs[0].token_ids


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preempted_prompts_are_scored_once(checkpoint: str, reference, async_scheduling: bool) -> None:
    """A KV pool too small for every request at once: sequences are preempted mid-prompt and mid-output and
    recomputed; each prompt's logprobs still hold every position once, as transformers has them."""
    prompts = [_prompt(10 + i, 40 + 7 * i) for i in range(4)]
    llm = tiny_llm(checkpoint, num_kv_blocks=14, block_size=8, max_num_batched_tokens=24,
                   async_scheduling=async_scheduling)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                   prompt_logprobs=1), use_tqdm=False)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    for prompt, output in zip(prompts, outputs):
        _check(prompt, output.prompt_logprobs, reference(prompt), top=1)


def test_several_completions_and_sample_logprobs(checkpoint: str, reference) -> None:
    """n=3: one set of prompt logprobs for the request; the sampled tokens' own logprobs as before."""
    prompt = _prompt(20, 25)
    llm = tiny_llm(checkpoint, num_kv_blocks=64, block_size=16)
    (output,) = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=3, logprobs=2,
                                                      prompt_logprobs=0), use_tqdm=False)
    _check(prompt, output.prompt_logprobs, reference(prompt), top=0)
    assert all(len(c.logprobs) == 3 for c in output.outputs)


def test_prompt_logprobs_bounds() -> None:
    assert SamplingParams(prompt_logprobs=MAX_LOGPROBS).prompt_logprobs == MAX_LOGPROBS
    for bad in (-1, MAX_LOGPROBS + 1, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_one_token_prompt(checkpoint: str) -> None:
    (output,) = tiny_llm(checkpoint, num_kv_blocks=8, block_size=16).generate(
        [[5]], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2), use_tqdm=False)
    assert output.prompt_logprobs == [None]


def test_a_prompt_that_fills_the_context_is_scored(checkpoint: str, reference) -> None:
    """An echo with max_tokens 0 (the server's scoring request) may fill the whole context: the one token drawn after
    it is dropped, never stored. A generating request of the same prompt is refused."""
    from tinyvllm.engine.input_processor import InputError

    engine = tiny_llm(checkpoint, num_kv_blocks=16, block_size=16, max_model_len=48).llm_engine
    prompt = _prompt(30, 48)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    with pytest.raises(InputError, match="no room to generate"):
        engine.input_processor.process(prompt, params)
    engine.add_processed_request("scored", engine.input_processor.process(prompt, params, scoring=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (output,) = [o for o in outputs if o.finished]
    assert output.outputs[0].finish_reason == "length"
    _check(prompt, output.prompt_logprobs, reference(prompt), top=1)
