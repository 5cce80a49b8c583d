"""Where every layer attends within a sliding window (Mistral), the KV blocks that fell out of it are given back as a
sequence advances (BlockManager.remove_skipped_blocks): a prompt many windows long, chunked, then decoded, gives
transformers' greedy tokens while the blocks in use stay bounded by the window and a chunk; sequences whose whole
lengths would overflow a small pool run together; prefix caching and speculative decoding stay exact; and a model
with a layer that sees its whole context (Qwen2 below max_window_layers, Gemma 2's alternate layers) frees nothing.
A tiny random Mistral (window 24, block_size 16) on the CPU, in float32."""

from __future__ import annotations

import math

import pytest
import torch

from tests.test_model_families import HF_ARGS, _save
from tests.utils import hf_greedy
from tinyvllm import LLM, SamplingParams
from tinyvllm.config import ModelConfig
from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.engine.sequence import Sequence
from tinyvllm.model.registry import model_class

WINDOW, BLOCK_SIZE, CHUNK = 24, 16, 32  # (CHUNK: max_num_batched_tokens, so a long prompt takes many steps)
SMALL = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _prompt(length: int, seed: int) -> list[int]:
    return [(seed * 37 + 11 * j + j * j) % 250 + 2 for j in range(length)]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> tuple[str, object]:
    import transformers

    path = _save(str(tmp_path_factory.mktemp("mistral-window")), "Mistral", 4, sliding_window=WINDOW, **SMALL)
    return path, transformers.MistralForCausalLM.from_pretrained(path, **HF_ARGS).eval()


def _llm(path: str, **kwargs) -> LLM:
    options = dict(skip_tokenizer_init=True, device="cpu", block_size=BLOCK_SIZE, max_num_batched_tokens=CHUNK,
                   num_kv_blocks=64)
    return LLM(path, **{**options, **kwargs})


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> tuple[list[list[int]], list]:
    """Each prompt's tokens, and the step stats of the run."""
    stats: list = []
    llm.llm_engine.add_step_callback(stats.append)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    llm.llm_engine.engine_core.block_manager.check_whole()
    return [o.outputs[0].token_ids for o in outputs], stats


@pytest.mark.parametrize("enable_prefix_caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
def test_long_prompt_gives_transformers_tokens_in_blocks_bounded_by_the_window(mistral, enable_prefix_caching):
    """A 300-token prompt (19 blocks; 10 chunks) and 24 greedy tokens: transformers' tokens, and at no step more than
    the window's and a chunk's blocks in use."""
    path, hf = mistral
    prompt = _prompt(300, 1)
    llm = _llm(path, enable_prefix_caching=enable_prefix_caching)
    assert llm.llm_engine.engine_core.block_manager.sliding_window == WINDOW
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    (tokens,), stats = _run(llm, [prompt], params)
    assert tokens == hf_greedy(hf, prompt, 24)
    used = [s.num_blocks_used for s in stats]
    assert max(used) <= math.ceil((WINDOW + CHUNK) / BLOCK_SIZE) + 1 < math.ceil(300 / BLOCK_SIZE)
    decoding = [s.num_blocks_used for s in stats if s.num_prefill_tokens == 0]
    assert max(decoding) <= math.ceil(WINDOW / BLOCK_SIZE) + 2


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_sequences_that_overflow_the_pool_whole_run_together(mistral, async_scheduling):
    """Four prompts of 90 to 260 tokens would need 50 blocks whole; a pool of 20 serves them at once, without a
    preemption, and each gets the tokens it gets alone."""
    path, _ = mistral
    prompts = [_prompt(n, seed) for seed, n in enumerate((150, 260, 90, 200))]
    alone = [_run(_llm(path), [p])[0][0] for p in prompts]
    num_blocks = 20
    assert sum(math.ceil((len(p) + GREEDY.max_tokens) / BLOCK_SIZE) for p in prompts) > 2 * num_blocks
    together, stats = _run(_llm(path, num_kv_blocks=num_blocks, async_scheduling=async_scheduling), prompts)
    assert together == alone
    assert max(s.num_running for s in stats) == len(prompts) and sum(s.num_preemptions for s in stats) == 0


def test_a_prompt_longer_than_the_pool_is_taken(mistral, tmp_path):
    """A pool of 7 blocks (112 tokens) holds the window, a chunk and a partial block at each end (88 tokens): a
    300-token prompt is taken (not refused as longer than the cache) and gets transformers' tokens. Without the window
    (the same config without sliding_window) the same request is refused, naming the cache's size."""
    path, hf = mistral
    prompt = _prompt(300, 5)
    llm = _llm(path, num_kv_blocks=7)
    assert llm.llm_engine.engine_core.kv_capacity_tokens >= len(prompt) + GREEDY.max_tokens
    (tokens,), stats = _run(llm, [prompt])
    assert tokens == hf_greedy(hf, prompt, GREEDY.max_tokens)
    assert max(s.num_blocks_used for s in stats) <= 7 and sum(s.num_preemptions for s in stats) == 0
    unwindowed = _llm(_save(str(tmp_path / "mistral"), "Mistral", 4, sliding_window=None, **SMALL), num_kv_blocks=7)
    with pytest.raises(ValueError, match="whole cache holds 112"):
        unwindowed.generate([prompt], GREEDY, use_tqdm=False)


def test_shared_prefix_from_the_cache_gives_transformers_tokens(mistral):
    """Two requests that share a 200-token prefix arrive together (the second waits for the first's blocks and takes
    them from the cache), then a third: each gets transformers' tokens, the later ones from cached blocks of which
    only those in the window are held."""
    path, hf = mistral
    prefix = _prompt(200, 7)
    prompts = [prefix + _prompt(12, seed) for seed in (1, 2, 3)]
    llm = _llm(path)
    first, _ = _run(llm, prompts[:2])
    (third,), stats = _run(llm, prompts[2:])
    assert first + [third] == [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    assert llm.llm_engine.get_stats()["prefix_cache_hits"] >= 2 * 192
    assert max(s.num_blocks_used for s in stats) <= math.ceil((WINDOW + CHUNK) / BLOCK_SIZE) + 1


def test_cached_prefix_past_the_window_enters_unowned():
    """A sequence that finds a prefix longer than the window in the cache holds only the cached blocks its queries can
    still see: the ones before are in its table (positions index into it) but not referenced, and it frees only what
    it holds."""
    manager = BlockManager(num_blocks=16, block_size=4, sliding_window=6)
    params = SamplingParams()
    tokens = list(range(2, 30))  # 28 tokens: 7 blocks
    a = Sequence(0, "a", 0, tokens, params, 0)
    assert manager.allocate(a, len(tokens))
    a.num_computed_tokens = len(tokens)
    manager.cache_computed_blocks(a)
    manager.remove_skipped_blocks(a)  # (28 - 6) // 4 = 5 blocks out of the window
    assert a.num_skipped_blocks == 5 and manager.num_free_blocks == 16 - 2
    blocks = list(a.block_table)
    manager.free(a)
    b = Sequence(1, "b", 0, tokens + [99], params, 0)
    cached = manager.find_cached_prefix(b)
    assert cached == blocks
    assert manager.allocate(b, 1, cached)
    assert b.block_table[:7] == cached and b.num_skipped_blocks == 5
    assert [manager.blocks[i].ref_count for i in b.block_table] == [0] * 5 + [1] * 3
    manager.free(b)
    manager.check_whole()


def test_speculative_decoding_with_blocks_given_back(mistral):
    """Prompt-lookup proposals on a prompt that repeats itself: rejected proposals give back the blocks past the
    tokens while the window gives back those before; the tokens are those without speculation."""
    path, _ = mistral
    prompts = [[(j % 23) * 9 + 5 for j in range(180)], _prompt(200, 2)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain, _ = _run(_llm(path), prompts, params)
    llm = _llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                         "prompt_lookup_max": 3})
    speculated, stats = _run(llm, prompts, params)
    assert speculated == plain
    counts = llm.llm_engine.get_stats()
    assert counts["spec_decode_num_draft_tokens"] > counts["spec_decode_num_accepted_tokens"] > 0
    assert max(s.num_blocks_used for s in stats) <= 2 * (math.ceil((WINDOW + CHUNK) / BLOCK_SIZE) + 1)


@pytest.mark.parametrize("family,config,window", [
    ("Mistral", dict(sliding_window=WINDOW), WINDOW),
    ("Mistral", dict(sliding_window=None), None),
    ("Qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1), None),  # layer 0 full
    ("Qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0), WINDOW),
    ("Gemma2", dict(sliding_window=WINDOW), None),  # (even layers windowed, odd ones full)
    ("Gemma2", dict(sliding_window=WINDOW, layer_types=["sliding_attention"] * 2), WINDOW),
])
def test_the_window_that_bounds_every_layer(family: str, config: dict, window: int | None) -> None:
    """CausalLM.sliding_window, from the layers' own windows: a window only where every layer has one."""
    import transformers

    hf_config = getattr(transformers, f"{family}Config")(**{**SMALL, "vocab_size": 256, "num_hidden_layers": 2,
                                                             **config}).to_dict()
    hf_config["architectures"] = [f"{family}ForCausalLM"]
    model_config = ModelConfig.from_hf_dict(hf_config)
    with torch.device("meta"):
        model = model_class(model_config.architecture)(model_config, 64)
    assert model.sliding_window == window


def test_a_layer_without_the_window_keeps_every_block(tmp_path):
    """Qwen2 whose first layer attends to its whole context: nothing is given back, the blocks in use grow with the
    prompt, and the tokens are transformers'."""
    import transformers

    path = _save(str(tmp_path / "qwen2"), "Qwen2", 5, use_sliding_window=True, sliding_window=WINDOW,
                 max_window_layers=1, **SMALL)
    prompt = _prompt(150, 3)
    llm = _llm(path)
    assert llm.llm_engine.engine_core.block_manager.sliding_window is None
    (tokens,), stats = _run(llm, [prompt])
    assert max(s.num_blocks_used for s in stats) == math.ceil((len(prompt) + GREEDY.max_tokens - 1) / BLOCK_SIZE)
    hf = transformers.Qwen2ForCausalLM.from_pretrained(path, **HF_ARGS).eval()
    assert tokens == hf_greedy(hf, prompt, GREEDY.max_tokens)
