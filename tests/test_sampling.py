"""Sampling: seeds, top-k/top-p/min-p against the distribution they define, penalties, logprobs,
stop conditions."""

import json
import math
import random
import shutil
from collections import Counter

import pytest
import torch

from tests.utils import hf_model, our_logits, save_tiny_llama
from tinyvllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def small_vocab_llm(tmp_path_factory):
    # vocab 12 with larger weights: a few tokens share most of the mass, the rest a long tail
    path = save_tiny_llama(str(tmp_path_factory.mktemp("v12")), seed=11, vocab_size=12, initializer_range=0.3)
    return LLM(path, skip_tokenizer_init=True, device="cpu", num_kv_blocks=256, max_num_seqs=256), path


def chi_square_ok(counts: Counter, probs: torch.Tensor, n: int) -> bool:
    """Pearson's chi-square against the expected counts, at the 0.1% level."""
    support = [i for i in range(len(probs)) if probs[i] > 0]
    stat = sum((counts.get(i, 0) - n * float(probs[i])) ** 2 / (n * float(probs[i])) for i in support)
    df = len(support) - 1
    # Wilson–Hilferty approximation of the chi-square quantile at 0.999
    z = 3.09
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < critical


def expected_distribution(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, min_p: float):
    probs = (logits.double() / temperature).softmax(-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for rank, idx in enumerate(order.tolist()):
        if (top_k > 0 and rank >= top_k) or (rank > 0 and mass >= top_p):
            break
        if probs[idx] < min_p * probs[order[0]]:
            break
        keep[idx] = True
        mass += float(probs[idx])
    truncated = torch.where(keep, probs, 0.0)
    return truncated / truncated.sum()


@pytest.mark.parametrize("temperature,top_p,top_k,min_p", [(0.8, 0.9, -1, 0.0), (1.3, 1.0, 5, 0.0),
                                                           (1.0, 1.0, -1, 0.1)])
def test_sampled_frequencies_follow_the_truncated_softmax(small_vocab_llm, temperature, top_p, top_k, min_p):
    llm, _ = small_vocab_llm
    prompt = [3, 1, 4, 1, 5]
    logits = our_logits(llm, prompt)[-1]
    expected = expected_distribution(logits, temperature, top_p, top_k, min_p)
    n = 3000
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, max_tokens=1,
                            ignore_eos=True)
    outputs = llm.generate([prompt] * n, params, use_tqdm=False)
    counts = Counter(o.outputs[0].token_ids[0] for o in outputs)
    assert all(expected[t] > 0 for t in counts), "a token outside the truncated support was drawn"
    assert chi_square_ok(counts, expected, n), (counts, expected)


def test_seeded_request_reproducible_whatever_the_batch(small_vocab_llm):
    llm, _ = small_vocab_llm
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate([[2, 3, 4]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    rng = random.Random(5)
    others = [[rng.randrange(12) for _ in range(rng.randint(1, 30))] for _ in range(9)]
    params = [SamplingParams(temperature=1.0, max_tokens=rng.randint(5, 30), ignore_eos=True) for _ in others]
    mixed = llm.generate(others[:4] + [[2, 3, 4]] + others[4:], params[:4] + [seeded] + params[4:], use_tqdm=False)
    assert mixed[4].outputs[0].token_ids == alone
    unseeded = llm.generate([[2, 3, 4]] * 2, SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),
                            use_tqdm=False)
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


def test_n_completions_differ_and_are_seeded(small_vocab_llm):
    llm, _ = small_vocab_llm
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    first = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0]
    again = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]


def test_top_k_1_equals_greedy(small_vocab_llm):
    llm, _ = small_vocab_llm
    prompts = [[1, 2, 3], [9, 9], [4, 5, 6, 7, 8]]
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    top1 = llm.generate(prompts, SamplingParams(temperature=1.5, top_k=1, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in top1]


def test_logprobs_match_log_softmax_of_reference_logits(small_vocab_llm):
    llm, path = small_vocab_llm
    prompt = [1, 2, 3, 4]
    out = llm.generate([prompt], SamplingParams(temperature=0.9, seed=3, max_tokens=6, logprobs=3,
                                                ignore_eos=True), use_tqdm=False)[0].outputs[0]
    hf = hf_model(path)
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([prompt + out.token_ids])).logits[0].float(), -1)
    assert len(out.logprobs) == len(out.token_ids)
    total = 0.0
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + step]
        assert abs(entry[token].logprob - row[token].item()) < 1e-4
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(3).indices.tolist()
        assert set(top) <= set(entry)
        total += entry[token].logprob
    assert abs(out.cumulative_logprob - total) < 1e-4


def test_penalties_change_the_output_and_repetition_penalty_discourages_repeats(small_vocab_llm):
    llm, _ = small_vocab_llm
    prompt = [1, 2, 3]
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    penalized = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                      frequency_penalty=2.0, presence_penalty=1.0),
                             use_tqdm=False)[0].outputs[0].token_ids
    assert len(set(penalized)) > len(set(plain))
    repeated = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                     repetition_penalty=5.0), use_tqdm=False)[0].outputs[0].token_ids
    assert len(set(repeated)) > len(set(plain))


def test_stop_strings_exclude_the_stop_and_min_tokens_hold(tiny_text_llm):
    llm = tiny_text_llm
    base = llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    text = base.text
    assert len(text) > 12
    stop = text[8:11]
    first = text.find(stop)
    out = llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:first]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=stop,
                                                        include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[:first + len(stop)]

    # stop_token_ids: stops at the first occurrence, unless min_tokens holds it off.
    tokens = base.token_ids
    stop_token = tokens[2]
    first_at = tokens.index(stop_token)
    out = llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                       stop_token_ids=[stop_token]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[:first_at + 1] and out.finish_reason == "stop" and out.stop_reason == stop_token
    held = llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, min_tokens=10,
                                                        stop_token_ids=[stop_token]), use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= 10
    assert stop_token not in held.token_ids[:9]
    assert base.finish_reason == "length" and len(base.token_ids) == 40


def test_eos_ends_a_request_unless_ignored(tiny_text_llm, tiny_text_checkpoint, tmp_path):
    tokens = tiny_text_llm.generate(["Once"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                                    use_tqdm=False)[0].outputs[0].token_ids
    # The same model, with its 5th token declared as EOS in its config.
    shutil.copytree(tiny_text_checkpoint, tmp_path / "model")
    for name in ("config.json", "generation_config.json"):
        path = tmp_path / "model" / name
        if path.exists():
            path.write_text(json.dumps({**json.loads(path.read_text()), "eos_token_id": tokens[4]}))
    llm = LLM(str(tmp_path / "model"), device="cpu", num_kv_blocks=64)
    out = llm.generate(["Once"], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0]
    ignored = llm.generate(["Once"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == tokens[:tokens.index(tokens[4]) + 1]
    assert ignored.token_ids == tokens
