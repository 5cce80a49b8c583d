"""Speculative decoding with n-gram proposals (issue 48): the config, the proposer's matching rules, the scheduler's
reservation and roll-back of proposals' slots, and the engine end to end on random tiny Llamas: greedy output equal
to greedy without speculation token for token (batches, preemption, max_tokens, stop tokens inside an accepted run,
logprobs, prefix caching), seeded sampling equal too, and sampled output distributed as the target model's (a
chi-square test on a small vocabulary)."""

from __future__ import annotations

import math
import random
from collections import Counter

import numpy as np
import pytest
import torch

from tests.utils import hf_model, save_tiny_llama, tiny_llm
from tinyvllm import SamplingParams
from tinyvllm.config import ConfigError, EngineConfig, SpeculativeConfig
from tinyvllm.contract import ModelRunnerOutput
from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.engine.scheduler import Scheduler
from tinyvllm.engine.sequence import Sequence
from tinyvllm.spec_decode import Proposer
from tinyvllm.spec_decode.ngram_proposer import ngram_proposal
from tinyvllm.worker.rejection_sampler import accepted_run

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


# ---- the config ---------------------------------------------------------------------------------------------------
def test_speculative_config_defaults_and_refusals():
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3}) \
        == SpeculativeConfig("ngram", 3, 5, 5)
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}') \
        == SpeculativeConfig("ngram", 2, 4, 4)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}) \
        == SpeculativeConfig("ngram", 2, 2, 2)
    assert SpeculativeConfig.parse({"model": "/some/where", "num_speculative_tokens": 3}) \
        == SpeculativeConfig("draft_model", 3, model="/some/where")  # (vLLM's rule: a model means a draft model)
    refusals = {
        "needs 'model'": {"method": "draft_model", "num_speculative_tokens": 3},
        "prompt_lookup_max is the 'ngram' method's": {"method": "draft_model", "model": "/some/where",
                                                      "num_speculative_tokens": 3, "prompt_lookup_max": 3},
        "'ngram' takes no 'model'": {"method": "ngram", "model": "/some/where", "num_speculative_tokens": 3},
        "method must be one of ngram, draft_model": {"method": "eagle", "num_speculative_tokens": 3},
        "num_speculative_tokens must be a positive integer": {"method": "ngram"},
        "prompt_lookup_min=4 is more than prompt_lookup_max=2": {"method": "ngram", "num_speculative_tokens": 2,
                                                                 "prompt_lookup_min": 4, "prompt_lookup_max": 2},
        "did you mean 'prompt_lookup_max'": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_mx": 3},
        "not valid JSON": "{method: ngram}",
    }
    for message, value in refusals.items():
        with pytest.raises(ConfigError, match=message):
            EngineConfig.from_kwargs(speculative_config=value)
    with pytest.raises(ConfigError, match="draft model runs with tensor_parallel_size 1"):
        EngineConfig.from_kwargs(speculative_config={"model": "/some/where", "num_speculative_tokens": 3},
                                 tensor_parallel_size=2)
    draft = {"model": "/some/where", "num_speculative_tokens": 3}
    with pytest.raises(ConfigError, match="draft model runs without async scheduling"):
        EngineConfig.from_kwargs(speculative_config=draft, async_scheduling=True)
    assert not EngineConfig.from_kwargs(speculative_config=draft).resolve_async_scheduling(torch.device("cuda"))
    assert EngineConfig.from_kwargs(speculative_config=NGRAM).resolve_async_scheduling(torch.device("cuda"))


def test_the_cli_takes_speculative_config_as_json():
    import argparse

    from tinyvllm.entrypoints.cli import add_engine_args, engine_config

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert engine_config(args).resolve_speculative() == SpeculativeConfig("ngram", 3, 5, 5)


# ---- the n-gram proposer ------------------------------------------------------------------------------------------
def _propose(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    return ngram_proposal(np.array(tokens, dtype=np.int64), min_n, max_n, k)


def test_ngram_matching_rules():
    assert _propose([1, 2, 3, 4, 2, 3], 2, 3, 4) == [4, 2, 3]  # (vLLM's example: what follows, up to the end)
    assert _propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 1, 3, 2) == [9, 1]  # the earliest of equally long matches
    assert _propose([5, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 1, 3, 2) == [7, 1]  # the longest match wins over an earlier one
    assert _propose([5, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 1, 2, 2) == [9, 1]  # ... up to max_n: then the earliest
    assert _propose([1, 2, 3, 9, 4, 3], 2, 3, 2) == []  # only a 1-gram matches: shorter than min_n
    assert _propose([1, 2, 3], 1, 3, 2) == []  # nothing occurs twice
    assert _propose([7, 7], 1, 3, 5) == [7]  # a match's continuation may overlap the suffix
    assert _propose([4, 5, 4, 5, 4], 2, 2, 8) == [5, 4]  # (5, 4) first at 1: what follows it, as far as it goes
    assert _propose([4, 5, 4, 5, 4], 1, 3, 0) == []


# ---- the rejection sampler ----------------------------------------------------------------------------------------
def test_accepted_run_stops_at_the_first_difference():
    assert accepted_run([5, 6, 7], [5, 6]) == [5, 6, 7]  # all accepted, and the token after them
    assert accepted_run([5, 9, 7], [5, 6]) == [5, 9]  # d2 rejected: the target's own token instead
    assert accepted_run([4, 6, 7], [5, 6]) == [4]  # (d2 would match, but follows a rejected one)
    assert accepted_run([4], []) == [4]


# ---- the scheduler ------------------------------------------------------------------------------------------------
class _Fixed(Proposer):
    """Proposes the same tokens for every sequence, cut to what it may propose."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.asked: list[int] = []

    def propose(self, seq_ids, token_ids, max_num_tokens):
        self.asked += max_num_tokens
        return [self.tokens[:k] for k in max_num_tokens]


def _scheduler(proposer: Proposer, num_blocks: int = 32, k: int = 4, max_model_len: int = 256) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, 4), 8, 64, max_model_len, proposer=proposer, num_speculative_tokens=k)


def _add(scheduler: Scheduler, prompt: list[int], **params) -> Sequence:
    seq = Sequence(len(scheduler.seqs), "r", 0, prompt, SamplingParams(ignore_eos=True, **params), seed=0)
    scheduler.add(seq)
    return seq


def test_the_scheduler_reserves_rolls_back_and_gives_back_the_slots_of_rejected_proposals():
    scheduler = _scheduler(_Fixed([10, 11, 12, 13]))
    seq = _add(scheduler, [1, 2, 3], max_tokens=50)
    step = scheduler.schedule()  # the prompt: no proposals
    assert step.num_new_tokens == [3] and not step.scheduled_spec_decode_tokens
    scheduler.update_from_output(step, ModelRunnerOutput([0], [[4]], [None]))
    step = scheduler.schedule()  # [4] and four proposals: 8 tokens, slots up to 8 (two blocks of 4 more)
    assert step.num_new_tokens == [5] and step.scheduled_spec_decode_tokens == {0: [10, 11, 12, 13]}
    assert len(seq.block_table) == 2 and seq.num_computed_tokens == 8 and seq.num_output_placeholders == 1
    # one accepted, then the target's own token: 10, 20
    scheduler.update_from_output(step, ModelRunnerOutput([0], [[10, 20]], [None]))
    assert seq.token_ids == [1, 2, 3, 4, 10, 20] and seq.num_computed_tokens == 5  # (4 and 10 are in the cache)
    assert len(seq.block_table) == 2  # six tokens need both blocks
    assert (scheduler.num_drafts, scheduler.num_draft_tokens, scheduler.num_accepted_tokens) == (1, 4, 1)
    step = scheduler.schedule()
    assert step.num_new_tokens == [5] and len(seq.block_table) == 3
    scheduler.update_from_output(step, ModelRunnerOutput([0], [[30]], [None]))  # all four rejected
    assert seq.num_computed_tokens == 6 and len(seq.block_table) == 2  # the third block went back
    step = scheduler.schedule()
    assert step.truncated_block_tables == {0: 2} and step.new_block_ids == {0: seq.block_table[2:]}
    scheduler.finish(seq, "abort")
    scheduler.block_manager.check_whole()


def test_proposals_stop_short_of_max_tokens_and_max_model_len():
    proposer = _Fixed([10, 11, 12, 13])
    scheduler = _scheduler(proposer, max_model_len=12)
    _add(scheduler, [1, 2, 3], max_tokens=4)
    _add(scheduler, [1, 2, 3, 4, 5, 6, 7, 8], max_tokens=50)
    step = scheduler.schedule()
    scheduler.update_from_output(step, ModelRunnerOutput([0, 1], [[4], [9]], [None, None]))
    step = scheduler.schedule()
    # one output of max_tokens=4: the step draws one token anyway, so two proposals; 9 tokens of 12: two as well
    assert step.scheduled_spec_decode_tokens == {0: [10, 11], 1: [10, 11]} and proposer.asked[-2:] == [2, 2]
    out = scheduler.update_from_output(step, ModelRunnerOutput([0, 1], [[10, 11, 5], [10, 11, 5]], [None, None]))
    assert [out.token_ids[e] for e in out.finished] == [5, 5]  # both end exactly at their limit
    assert not scheduler.has_unfinished()
    scheduler.block_manager.check_whole()


def test_no_proposals_where_the_pool_is_short():
    scheduler = _scheduler(_Fixed([10, 11, 12, 13]), num_blocks=2)
    seq = _add(scheduler, [1, 2, 3], max_tokens=50)
    scheduler.update_from_output(scheduler.schedule(), ModelRunnerOutput([0], [[4]], [None]))
    step = scheduler.schedule()  # 4 tokens fit one block; proposals would need a second: one left, kept for seq
    assert step.num_new_tokens == [1] and not step.scheduled_spec_decode_tokens and len(seq.block_table) == 1


def test_proposals_under_a_grammar_only_as_it_allows_none_with_penalties_or_before_min_tokens():
    class Grammar:  # (a stand-in for SequenceGrammar that allows anything, but of proposals only the first)
        terminated = False

        def ready(self):
            return True

        def accept(self, token):
            pass

        def valid_drafts(self, drafts):
            return drafts[:1]

    proposer = _Fixed([10, 11])
    scheduler = _scheduler(proposer)
    constrained = _add(scheduler, [1, 2, 3], max_tokens=50)
    constrained.grammar = Grammar()
    _add(scheduler, [1, 2, 3], max_tokens=50, repetition_penalty=1.2)
    _add(scheduler, [1, 2, 3], max_tokens=50, min_tokens=3)
    _add(scheduler, [1, 2, 3], max_tokens=50)
    proposed = []
    for _ in range(4):
        step = scheduler.schedule()
        proposed.append({i: tuple(d) for i, d in step.scheduled_spec_decode_tokens.items()})
        sampled = [i for i in step.seq_ids if scheduler.seqs[i].num_output_placeholders]
        scheduler.update_from_output(step, ModelRunnerOutput(sampled, [[7] for _ in sampled], [None] * len(sampled)))
    # (the prompts; then min_tokens=3 holds sequence 2 back twice; the grammar keeps sequence 0's first proposal)
    full, first = (10, 11), (10,)
    assert proposed == [{}, {0: first, 3: full}, {0: first, 3: full}, {0: first, 2: full, 3: full}]


# ---- the engine, end to end ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[3, 11])
def checkpoint(request, tmp_path_factory) -> str:
    """Random tiny Llamas (two configurations)."""
    overrides = {} if request.param == 3 else dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3,
                                                   num_hidden_layers=3)
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny")), seed=request.param, **overrides)


def _repeating_prompts(num: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a phrase (so that proposals are found and often accepted), and one that does not."""
    rng = random.Random(seed)
    prompts = []
    for i in range(num):
        phrase = [rng.randrange(2, 256) for _ in range(rng.randrange(3, 9))]
        prompts.append((phrase * 8)[:rng.randrange(10, 40)] if i % 4 != 3 else
                       [rng.randrange(2, 256) for _ in range(20)])
    return prompts


def _generate(checkpoint: str, prompts, params, **kwargs):
    llm = tiny_llm(checkpoint, **kwargs)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    llm.llm_engine.engine_core.block_manager.check_whole()
    return outputs, llm.llm_engine.get_stats()


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("batch_size", [1, 5, 16])
def test_greedy_equals_greedy_without_speculation(checkpoint, batch_size):
    prompts = _repeating_prompts(batch_size, seed=batch_size)
    max_tokens = [40, 1, 2, 3, 5, 8, 13, 21, 34, 39, 12, 27, 6, 31, 19, 25][:batch_size]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    plain, _ = _generate(checkpoint, prompts, params)
    spec, stats = _generate(checkpoint, prompts, params, speculative_config=NGRAM)
    assert _tokens(spec) == _tokens(plain)
    assert [len(t) for t in _tokens(spec)] == [p.max_tokens for p in params]  # never more than asked
    assert stats["spec_decode_num_accepted_tokens"] > 0 and stats["spec_decode_num_drafts"] > 0
    assert stats["spec_decode_num_accepted_tokens"] <= stats["spec_decode_num_draft_tokens"]


def test_greedy_equal_under_preemption(checkpoint):
    prompts = _repeating_prompts(8, seed=5)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain, _ = _generate(checkpoint, prompts, params)
    kwargs = dict(num_kv_blocks=14, block_size=8, speculative_config=NGRAM)
    spec, stats = _generate(checkpoint, prompts, params, **kwargs)
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert _tokens(spec) == _tokens(plain)


def test_greedy_equal_with_async_scheduling(checkpoint):
    """n-gram speculation keeps async scheduling: a step is launched ahead while no lookup finds proposals, and the
    engine reads the step in flight back first where one does (Scheduler.speculation_ready), so both kinds of step
    occur, among preemptions, with the output unchanged."""
    prompts = _repeating_prompts(8, seed=12)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 3, 25, 31, 12, 44, 7, 36)]
    plain, _ = _generate(checkpoint, prompts, params)
    llm = tiny_llm(checkpoint, speculative_config=NGRAM, async_scheduling=True, num_kv_blocks=16, block_size=8)
    steps = []
    llm.llm_engine.add_step_callback(steps.append)
    spec = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    llm.llm_engine.engine_core.block_manager.check_whole()
    assert _tokens(spec) == _tokens(plain)
    assert stats["spec_decode_num_accepted_tokens"] > 0 and stats["num_preemptions"] > 0
    assert any(s.num_inputs_in_flight for s in steps)  # (steps launched ahead of the one before)


def test_a_stop_token_inside_an_accepted_run(checkpoint):
    prompt = _repeating_prompts(1, seed=7)[0]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    (full,), _ = _generate(checkpoint, [prompt], greedy)
    output = full.outputs[0].token_ids
    stops = sorted(set(output[2:]))  # each token of the output, as the stop token of a request of its own
    params = [SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[t]) for t in stops]
    spec, stats = _generate(checkpoint, [prompt] * len(stops), params, speculative_config=NGRAM)
    assert stats["spec_decode_num_accepted_tokens"] > 0
    for stop, out in zip(stops, spec):
        end = output.index(stop) + 1
        assert out.outputs[0].token_ids == output[:end] and out.outputs[0].stop_reason == stop


def test_logprobs_prompt_logprobs_and_prefix_caching_with_speculation(checkpoint):
    prompts = _repeating_prompts(4, seed=9)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    plain, _ = _generate(checkpoint, prompts, params)
    llm = tiny_llm(checkpoint, speculative_config=NGRAM, block_size=4)
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert _tokens(spec) == _tokens(plain)
    for a, b in zip(plain, spec):
        for mine, theirs in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):  # every accepted token's own
            assert mine.keys() == theirs.keys()
            assert all(abs(mine[t].logprob - theirs[t].logprob) < 1e-4 for t in mine)
        assert [lp and sorted(lp) for lp in a.prompt_logprobs] == [lp and sorted(lp) for lp in b.prompt_logprobs]
    # Follow-ups whose prompts hold those outputs: their blocks come from the prefix cache, which must hold no
    # rejected proposal's K/V
    follow = [p + o.outputs[0].token_ids[:-1] for p, o in zip(prompts, spec)]
    again = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    before = llm.llm_engine.get_stats()["prefix_cache_hits"]
    cached = llm.generate(follow, again, use_tqdm=False)
    assert llm.llm_engine.get_stats()["prefix_cache_hits"] > before
    fresh, _ = _generate(checkpoint, follow, again, enable_prefix_caching=False)
    assert _tokens(cached) == _tokens(fresh)


def test_seeded_sampling_draws_the_same_tokens_with_speculation(checkpoint):
    prompts = _repeating_prompts(6, seed=2)
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=i, max_tokens=30, ignore_eos=True)
              for i in range(len(prompts))]
    plain, _ = _generate(checkpoint, prompts, params)
    spec, stats = _generate(checkpoint, prompts, params, speculative_config=NGRAM)
    assert stats["spec_decode_num_drafts"] > 0
    assert _tokens(spec) == _tokens(plain)


def _chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square distribution's quantile at the normal quantile z (3.09: p = 0.999), by Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@torch.inference_mode()
def test_sampling_with_speculation_follows_the_target_distribution(tmp_path, method):
    """The joint distribution of output tokens 2 and 3 (the first that proposals decide: token 3 comes from an
    accepted proposal's position) against the exact one, from the Hugging Face model, at temperature 0.9 and
    top_k 5 over a vocabulary of 8. The draft model is the target itself: its greedy guesses are the likeliest
    tokens, accepted often and rejected often."""
    vocab, temperature, top_k = 8, 0.9, 5
    path = save_tiny_llama(str(tmp_path), seed=4, vocab_size=vocab, initializer_range=0.6, bos_token_id=0,
                           eos_token_id=1)
    prompt = [2, 3, 4, 5, 2, 3, 4, 5, 2, 3]
    num_samples = 3000
    params = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=3, ignore_eos=True)
    speculative = NGRAM if method == "ngram" else _draft(path)
    spec, stats = _generate(path, [prompt] * num_samples, params, speculative_config=speculative)
    assert stats["spec_decode_num_drafts"] > num_samples / 2
    observed = Counter(tuple(o.outputs[0].token_ids[1:]) for o in spec)

    model = hf_model(path)

    def target(contexts: list[list[int]]) -> torch.Tensor:
        logits = model(torch.tensor(contexts)).logits[:, -1].double() / temperature
        kept = logits.topk(top_k, dim=-1).indices
        masked = torch.full_like(logits, -math.inf).scatter(1, kept, logits.gather(1, kept))
        return masked.softmax(dim=-1)

    p1 = target([prompt])[0]
    p2 = target([prompt + [a] for a in range(vocab)])  # [t1, t2]
    p3 = target([prompt + [a, b] for a in range(vocab) for b in range(vocab)]).view(vocab, vocab, vocab)
    joint = torch.einsum("a,ab,abc->bc", p1, p2, p3)  # P(t2, t3)
    expected = (joint * num_samples).flatten()
    counts = torch.tensor([observed.get((b, c), 0) for b in range(vocab) for c in range(vocab)], dtype=torch.float64)
    assert counts[expected == 0].sum() == 0  # nothing outside the top-k
    # cells expected fewer than 5 times pooled into one
    big = expected >= 5
    e = torch.cat([expected[big], expected[~big].sum().view(1)])
    o = torch.cat([counts[big], counts[~big].sum().view(1)])
    keep = e > 0
    statistic = float(((o[keep] - e[keep]) ** 2 / e[keep]).sum())
    df = int(keep.sum()) - 1
    assert statistic < _chi_square_critical(df), (statistic, df)


def test_metrics_export_the_counters_with_vllms_names():
    from tinyvllm.entrypoints.openai.metrics import ServerMetrics

    class Engine:
        def get_stats(self):
            return {"spec_decode_num_drafts": 3, "spec_decode_num_draft_tokens": 12,
                    "spec_decode_num_accepted_tokens": 7}

    text = ServerMetrics(Engine(), "m").render()[0].decode()  # type: ignore[arg-type]
    for name, value in (("num_drafts", 3), ("num_draft_tokens", 12), ("num_accepted_tokens", 7)):
        assert f'tinyvllm:spec_decode_{name}_total{{model_name="m"}} {value:.1f}' in text


# ---- draft-model proposals ----------------------------------------------------------------------------------------
def _draft(path: str, k: int = 4) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def draft(tmp_path_factory) -> str:
    """A smaller random Llama (one layer) of the same vocabulary: its guesses are seldom the target's."""
    return save_tiny_llama(str(tmp_path_factory.mktemp("draft")), seed=21, num_hidden_layers=1)


def test_a_draft_model_that_is_the_target_has_its_guesses_accepted(checkpoint):
    """The target as its own draft guesses what the target draws: a wrong K/V in the draft's cache (a rejected
    guess kept, a catch-up chunk misplaced, blocks mixed up between sequences) would show as rejections. The
    prompts' catching up is split over steps (max_num_batched_tokens 16)."""
    prompts = _repeating_prompts(6, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 1, 2, 17, 33, 26)]
    plain, _ = _generate(checkpoint, prompts, params)
    spec, stats = _generate(checkpoint, prompts, params, speculative_config=_draft(checkpoint),
                            max_num_batched_tokens=16)
    assert _tokens(spec) == _tokens(plain)
    proposed, accepted = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
    assert proposed > 50 and accepted >= 0.95 * proposed  # (float32 near-ties between its two paths aside)


@pytest.mark.parametrize("batch_size", [1, 7])
def test_greedy_equals_greedy_without_speculation_with_a_draft_model(checkpoint, draft, batch_size):
    prompts = _repeating_prompts(batch_size, seed=10 + batch_size)
    max_tokens = [33, 1, 2, 5, 13, 21, 8][:batch_size]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    plain, _ = _generate(checkpoint, prompts, params)
    spec, stats = _generate(checkpoint, prompts, params, speculative_config=_draft(draft, k=3))
    assert _tokens(spec) == _tokens(plain)
    assert stats["spec_decode_num_drafts"] > 0


def test_greedy_equal_with_a_draft_model_under_preemption(checkpoint):
    prompts = _repeating_prompts(8, seed=6)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain, _ = _generate(checkpoint, prompts, params)
    kwargs = dict(num_kv_blocks=14, block_size=8, speculative_config=_draft(checkpoint))
    spec, stats = _generate(checkpoint, prompts, params, **kwargs)
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert _tokens(spec) == _tokens(plain)


def test_seeded_sampling_draws_the_same_tokens_with_a_draft_model(checkpoint, draft):
    prompts = _repeating_prompts(4, seed=8)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=24, ignore_eos=True)
              for i in range(len(prompts))]
    plain, _ = _generate(checkpoint, prompts, params)
    for path in (checkpoint, draft):
        spec, stats = _generate(checkpoint, prompts, params, speculative_config=_draft(path))
        assert stats["spec_decode_num_drafts"] > 0
        assert _tokens(spec) == _tokens(plain)


def test_a_draft_model_with_a_larger_vocabulary_is_refused(checkpoint, tmp_path):
    from tinyvllm import LLM

    big = save_tiny_llama(str(tmp_path), seed=1, num_hidden_layers=1, vocab_size=512)
    with pytest.raises(ConfigError, match="vocabulary .512 tokens. is larger than the target's"):
        LLM(checkpoint, skip_tokenizer_init=True, device="cpu", speculative_config=_draft(big))
