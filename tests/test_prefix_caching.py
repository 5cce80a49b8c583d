"""Automatic prefix caching: shared prefixes are computed once, outputs do not change, nothing leaks."""

import random

import pytest

from tests.utils import tiny_llama_fixture, tiny_llm
from tinyvllm import SamplingParams
from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.engine.sequence import Sequence

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


checkpoint = tiny_llama_fixture(seed=5)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(2)
    system = [rng.randrange(2, 256) for _ in range(70)]
    shared = [system + [rng.randrange(2, 256) for _ in range(rng.randint(1, 40))] for _ in range(8)]
    return {
        "shared": shared,
        "prefix_of_another": [system[:48], system[:48] + [9, 8, 7]],  # 48 = three full blocks
        "exact_blocks": [system[:64]],
    }


def make(checkpoint, caching, **kwargs):
    kwargs.setdefault("num_kv_blocks", 128)
    return tiny_llm(checkpoint, enable_prefix_caching=caching, **kwargs)


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_outputs_identical_with_and_without_caching(checkpoint, prompts):
    plain, cached = make(checkpoint, False), make(checkpoint, True)
    for group in prompts.values():
        expected = tokens(plain.generate(group, GREEDY, use_tqdm=False))
        assert tokens(cached.generate(group, GREEDY, use_tqdm=False)) == expected  # together
        for prompt, want in zip(group, expected):  # one after another, now mostly cached
            assert tokens(cached.generate([prompt], GREEDY, use_tqdm=False)) == [want]
    cached.llm_engine.engine_core.block_manager.check_whole()
    assert plain.llm_engine.get_stats()["prefix_cache_hits"] == 0


def test_hits_are_counted_and_only_uncached_tokens_are_prefilled(checkpoint, prompts):
    llm = make(checkpoint, True)
    engine = llm.llm_engine
    first = prompts["shared"][0]
    llm.generate([first], GREEDY, use_tqdm=False)
    before = engine.get_stats()
    second = prompts["shared"][1]
    out = llm.generate([second], GREEDY, use_tqdm=False)[0]
    after = engine.get_stats()
    hit = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    assert hit == 64  # the 70-token system prompt holds four full blocks of 16
    assert out.num_cached_tokens == 64
    assert after["prefix_cache_queries"] - before["prefix_cache_queries"] == len(second)
    assert after["prompt_tokens"] - before["prompt_tokens"] == len(second) - 64


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_follow_up_prompt_reuses_the_answer(checkpoint, prompts, async_scheduling):
    """A second chat turn holds the first turn's prompt and answer: every full block of both that was
    computed (the answer's last token never is) comes from the cache."""
    llm = make(checkpoint, True, async_scheduling=async_scheduling)
    engine = llm.llm_engine
    first = prompts["shared"][0]
    # An answer length whose last computed token completes a block: the step that finishes the request is
    # the one that fills it, so only caching at that step finds it.
    length = (1 - len(first)) % 16 + 16
    answer = llm.generate([first], SamplingParams(temperature=0, max_tokens=length, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    before = engine.get_stats()["prefix_cache_hits"]
    follow_up = first + answer + [5, 6, 7]
    out = llm.generate([follow_up], GREEDY, use_tqdm=False)[0]
    expected = len(first) + len(answer) - 1
    assert expected % 16 == 0
    assert engine.get_stats()["prefix_cache_hits"] - before == expected == out.num_cached_tokens
    engine.engine_core.block_manager.check_whole()


def test_fully_cached_prompt_recomputes_its_last_token(checkpoint, prompts):
    llm = make(checkpoint, True)
    prompt = prompts["exact_blocks"][0]
    first = tokens(llm.generate([prompt], GREEDY, use_tqdm=False))
    before = llm.llm_engine.get_stats()
    again = llm.generate([prompt], GREEDY, use_tqdm=False)
    after = llm.llm_engine.get_stats()
    assert tokens(again) == first
    assert again[0].num_cached_tokens == 48  # the last block is recomputed for its final token's logits
    assert after["prompt_tokens"] - before["prompt_tokens"] == 16


def test_eviction_and_preemption_with_a_small_pool(checkpoint, prompts):
    group = prompts["shared"] + prompts["prefix_of_another"]
    expected = tokens(make(checkpoint, False).generate(group, GREEDY, use_tqdm=False))
    llm = make(checkpoint, True, num_kv_blocks=14, max_num_batched_tokens=64)
    for _ in range(2):
        assert tokens(llm.generate(group, GREEDY, use_tqdm=False)) == expected
    engine = llm.llm_engine
    assert engine.engine_core.scheduler.num_preemptions >= 1
    engine.engine_core.block_manager.check_whole()


def test_n_and_abort_with_shared_blocks(checkpoint, prompts):
    llm = make(checkpoint, True)
    engine = llm.llm_engine
    prompt = prompts["shared"][0]
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=10, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    engine.add_request("a", prompt, GREEDY)
    engine.add_request("b", prompt, params)
    engine.step()
    engine.step()
    assert engine.abort_request("a") and engine.abort_request("b")
    assert not engine.has_unfinished_requests()
    engine.engine_core.block_manager.check_whole()


def test_hash_collision_does_not_share_blocks():
    manager = BlockManager(num_blocks=8, block_size=4)
    params = SamplingParams()
    a = Sequence(0, "a", 0, [1, 2, 3, 4, 5], params, 0, 0.0)
    assert manager.allocate(a, 5)
    a.num_computed_tokens = 5
    manager.cache_computed_blocks(a)
    b = Sequence(1, "b", 0, [9, 9, 9, 9, 5], params, 0, 0.0)
    b.block_hashes = list(a.block_hashes)  # forge a collision: same hash, other tokens
    assert manager.find_cached_prefix(b) == []
    c = Sequence(2, "c", 0, [1, 2, 3, 4, 7], params, 0, 0.0)
    assert manager.find_cached_prefix(c) == [a.block_table[0]]


def test_lru_eviction_keeps_recently_used_blocks():
    manager = BlockManager(num_blocks=4, block_size=2)
    params = SamplingParams()
    seqs = []
    for i, toks in enumerate(([1, 1, 1], [2, 2, 2])):
        s = Sequence(i, str(i), 0, toks, params, 0, 0.0)
        assert manager.allocate(s, 3)
        s.num_computed_tokens = 3
        manager.cache_computed_blocks(s)
        manager.free(s)
        seqs.append(s)
    # both first blocks are cached; a sequence needing 3 fresh blocks must evict the older ones first
    big = Sequence(5, "x", 0, [7, 7, 7, 7, 7, 7], params, 0, 0.0)
    assert manager.allocate(big, 6)
    again = Sequence(6, "y", 0, [2, 2, 2], params, 0, 0.0)
    assert len(manager.find_cached_prefix(again)) == 1  # [2, 2] survived, [1, 1] was evicted
    assert manager.find_cached_prefix(Sequence(7, "z", 0, [1, 1, 1], params, 0, 0.0)) == []


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_requests_arriving_together_compute_their_shared_prefix_once(checkpoint, prompts, async_scheduling):
    """Eight prompts with a 70-token system prompt (four full blocks) arrive together: the first computes the
    four blocks, the others wait for them in the cache and compute only their own tail. Without that (the
    scheduler's share_prefix_computation off) every prompt that fits in the first step computes them too. The
    tokens are the same either way, and no claim outlives its sequence."""
    group = prompts["shared"]
    runs = {}
    for share in (True, False):
        llm = make(checkpoint, True, async_scheduling=async_scheduling)
        core = llm.llm_engine.engine_core
        core.scheduler.share_prefix_computation = share
        out = tokens(llm.generate(group, GREEDY, use_tqdm=False))
        runs[share] = (out, core.scheduler.num_prompt_tokens, llm.llm_engine.get_stats()["prefix_cache_hits"])
        assert core.block_manager.claimed == {}
        core.block_manager.check_whole()
    (shared_out, shared_computed, shared_hits), (plain_out, plain_computed, plain_hits) = runs[True], runs[False]
    assert shared_out == plain_out
    total = sum(len(p) for p in group)
    assert shared_hits == 64 * (len(group) - 1) and shared_computed == total - shared_hits
    assert plain_hits == 0 and plain_computed == total  # (all eight fit in the first step: none found it cached)


def test_a_request_waiting_for_a_shared_prefix_is_seated_in_the_next_step(checkpoint, prompts):
    """With async scheduling the step after the one computing a shared prefix is planned before that step's tokens
    are read back: the prefix's blocks are in the cache from the moment their step is launched, so the request
    waiting for them is seated then, not a step later. Its tokens match a run without the prefix cache."""
    first, second = prompts["shared"][:2]
    llm = make(checkpoint, True, async_scheduling=True)
    engine = llm.llm_engine
    engine.add_request("first", first, GREEDY)
    engine.add_request("second", second, GREEDY)
    core = engine.engine_core
    # (launches the first's prompt, then, async, the next step; reads the first back)
    finished = {o.request_id: o for o in engine.step() if o.finished}
    assert not core.scheduler.waiting and core.has_step_in_flight
    seated = next(s for s in core.scheduler.running if s.request_id == "second")
    assert seated.num_cached_tokens == 64 and seated.num_computed_tokens == len(second)  # its tail in flight
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert engine.get_stats()["prefix_cache_hits"] == 64
    assert core.block_manager.claimed == {}
    core.block_manager.check_whole()
    plain = tokens(make(checkpoint, False).generate([first, second], GREEDY, use_tqdm=False))
    assert tokens([finished["first"], finished["second"]]) == plain


def test_a_request_waiting_for_a_claimed_prefix_runs_once_its_claimant_is_gone(checkpoint, prompts):
    """The sequence computing the shared blocks is aborted before they are cached: the one waiting for them
    must not wait for ever, and computes them itself."""
    llm = make(checkpoint, True)
    engine = llm.llm_engine
    first, second = prompts["shared"][:2]
    engine.add_request("first", first, GREEDY)
    engine.add_request("second", second, GREEDY)
    core = engine.engine_core
    step = core.scheduler.schedule()  # the first is admitted and claims the system prompt's blocks
    assert len(step.seq_ids) == 1 and core.block_manager.claimed
    assert [s.request_id for s in core.scheduler.waiting] == ["second"]
    engine.abort_request("first")
    assert core.block_manager.claimed == {}
    step = core.scheduler.schedule()
    assert [core.scheduler.seqs[i].request_id for i in step.seq_ids] == ["second"]
