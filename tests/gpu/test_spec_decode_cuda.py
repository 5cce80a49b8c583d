"""Speculative decoding on a CUDA GPU (CUDA graphs and async scheduling on, as by default), float32 tiny random
Llamas: greedy output equal to greedy without speculation with n-gram proposals (which keep async scheduling while
lookups find nothing) and with a draft model (a runner of its own, its decode steps through its own CUDA graphs); the
target as its own draft has its guesses accepted.

    python -m pytest -m cuda tests/gpu/test_spec_decode_cuda.py -ra      (on a GPU machine; skipped elsewhere)
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from tests.utils import CUDA_ONLY, save_tiny_llama
from tinyvllm import LLM, SamplingParams

pytestmark = CUDA_ONLY

ENGINE_ARGS = dict(skip_tokenizer_init=True, dtype="float32", gpu_memory_utilization=0.2, max_num_seqs=16,
                   max_num_batched_tokens=256)


def _prompts(num: int) -> list[list[int]]:
    """Prompts that repeat a phrase (n-gram proposals find something) and some that do not."""
    rng = random.Random(1)
    return [([rng.randrange(2, 256) for _ in range(rng.randrange(3, 9))] * 10)[:rng.randrange(20, 60)] if i % 3
            else [rng.randrange(2, 256) for _ in range(30)] for i in range(num)]


def _greedy(path: str, prompts: list[list[int]], **kwargs) -> tuple[list[list[int]], dict[str, float]]:
    llm = LLM(path, **ENGINE_ARGS, **kwargs)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (48, 5, 33, 17, 40, 2, 29, 44)]
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params[:len(prompts)], use_tqdm=False)]
    stats = llm.llm_engine.get_stats()
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, stats


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return save_tiny_llama(str(tmp_path_factory.mktemp("target")), seed=3, hidden_size=128, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_equal_with_speculation(target: str, tmp_path, batch: int) -> None:
    prompts = _prompts(batch)
    plain, _ = _greedy(target, prompts)
    draft = save_tiny_llama(str(tmp_path), seed=9, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    for name, config in (("ngram", {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                    "prompt_lookup_max": 3}),
                         ("self draft", {"method": "draft_model", "model": target, "num_speculative_tokens": 3}),
                         ("draft", {"method": "draft_model", "model": draft, "num_speculative_tokens": 3})):
        spec, stats = _greedy(target, prompts, speculative_config=config)
        assert spec == plain, name
        proposed, accepted = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
        assert stats["spec_decode_num_drafts"] > 0, name
        if name == "self draft":  # (float32: near-ties between its two paths aside)
            assert accepted >= 0.9 * proposed, (accepted, proposed)
