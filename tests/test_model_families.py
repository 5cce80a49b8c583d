"""The families beside Llama (Qwen2, Qwen3, Mistral) against transformers' own classes on random-weight configs
unlike each other (head dims 64 and 128, GQA and MHA, tied and untied embeddings, Qwen3's head_dim apart from
hidden / heads): float32 logits within 1e-4 over a prefill, and 32 greedy tokens identical; and sliding windows
shorter than the prompt."""

from __future__ import annotations

import random

import pytest
import torch

from tests.utils import TINY, hf_greedy, our_logits, relative_error
from tinyvllm import LLM, SamplingParams
from tinyvllm.config import ConfigError
from tinyvllm.entrypoints.bench_offline import draw_norm_weights

BASE = {k: v for k, v in TINY.items() if k not in ("hidden_size", "num_attention_heads", "num_key_value_heads")}
CONFIGS = {
    "qwen2-gqa-tied-hd64": ("Qwen2", dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                          tie_word_embeddings=True)),
    "qwen2-mha-untied-hd128": ("Qwen2", dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=2,
                                             tie_word_embeddings=False)),
    "qwen3-gqa-tied-hd128": ("Qwen3", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                           head_dim=128, tie_word_embeddings=True)),
    "qwen3-mha-untied-hd64": ("Qwen3", dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2,
                                            head_dim=64, tie_word_embeddings=False)),
    "mistral-gqa-untied-hd64": ("Mistral", dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                                tie_word_embeddings=False, sliding_window=None)),
}


def _save(path: str, family: str, seed: int, **config: object) -> str:
    import transformers

    torch.manual_seed(seed)
    hf_config = getattr(transformers, f"{family}Config")(**{**BASE, **config})
    model = getattr(transformers, f"{family}ForCausalLM")(hf_config)
    draw_norm_weights(model)  # (q_norm and k_norm too)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.1)  # (transformers starts them at 0, which would hide a bias left out)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=list(CONFIGS))
def family(request, tmp_path_factory) -> tuple[LLM, object]:
    import transformers

    name, config = CONFIGS[request.param]
    path = _save(str(tmp_path_factory.mktemp(request.param)), name, seed=len(request.param), **config)
    hf = getattr(transformers, f"{name}ForCausalLM").from_pretrained(path, dtype=torch.float32).eval()
    return LLM(path, skip_tokenizer_init=True, device="cpu", num_kv_blocks=64), hf


def test_logits_match_transformers(family) -> None:
    llm, hf = family
    rng = random.Random(2)
    for length in (1, 9, 70):
        ids = [rng.randrange(256) for _ in range(length)]
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0].float()
        assert relative_error(our_logits(llm, ids), ref) < 1e-4, length


def test_greedy_tokens_match_transformers(family) -> None:
    llm, hf = family
    prompt = [5, 17, 99, 3, 42, 7, 200, 31]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(hf, prompt, 32)


@pytest.mark.parametrize("family_name", ["Qwen2", "Qwen3"])
def test_two_ranks_chunks_and_async_scheduling_give_the_same_tokens(tmp_path, family_name: str) -> None:
    """Tensor parallelism (each rank its heads: Qwen2's biases and Qwen3's q/k norms split or shared alike), chunked
    prefill beside decodes and async scheduling: one rank's greedy tokens."""
    path = _save(str(tmp_path / family_name), family_name, 3, hidden_size=128, num_attention_heads=4,
                 num_key_value_heads=2)
    prompts = [[(7 * i + j) % 200 + 2 for j in range(3 + 11 * i)] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    results = []
    for kwargs in ({}, {"tensor_parallel_size": 2}, {"max_num_batched_tokens": 16, "async_scheduling": True}):
        llm = LLM(path, skip_tokenizer_init=True, device="cpu", num_kv_blocks=32, **kwargs)
        try:
            results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        finally:
            llm.llm_engine.shutdown()
    assert results[0] == results[1] == results[2]


@pytest.mark.parametrize("family_name,window", [("Mistral", dict(sliding_window=8)), (
    "Qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1))])
def test_sliding_windows_shorter_than_the_prompt_match_transformers(tmp_path, family_name: str, window: dict) -> None:
    """A window of 8 tokens under a 40-token prompt: in every layer (Mistral), or from max_window_layers on (Qwen2:
    its first layer sees the whole context); logits within 1e-4 and greedy tokens as transformers'."""
    import transformers

    path = _save(str(tmp_path / family_name), family_name, 4, hidden_size=128, num_attention_heads=2,
                 num_key_value_heads=1, **window)
    hf = getattr(transformers, f"{family_name}ForCausalLM").from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, skip_tokenizer_init=True, device="cpu", num_kv_blocks=32, max_num_batched_tokens=16)
    layers = llm.llm_engine.engine_core.model_runner.model.model.layers
    windows = [layer.self_attn.attn.sliding_window for layer in layers]
    assert windows == ([8, 8] if family_name == "Mistral" else [None, 8])
    prompt = [(11 * j + 5) % 250 + 2 for j in range(40)]
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    assert relative_error(our_logits(llm, prompt), ref) < 1e-4
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)  # (chunks of 16: the window across them)
    assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(hf, prompt, 16)


def test_an_unsupported_architecture_names_the_supported_ones(tmp_path) -> None:
    path = _save(str(tmp_path / "llama"), "Llama", 1, hidden_size=64, num_attention_heads=2)
    import json
    import os

    config = json.load(open(os.path.join(path, "config.json")))
    config["architectures"] = ["FalconForCausalLM"]
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ConfigError, match="Qwen3ForCausalLM"):
        LLM(path, skip_tokenizer_init=True, device="cpu", num_kv_blocks=8)
