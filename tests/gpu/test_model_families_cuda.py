"""The families beside Llama on a CUDA GPU (Triton kernels, CUDA graphs), against transformers in float32 on the same
GPU, on tests/test_model_families.py's random-weight configs: our logits over a prefill in float32 (within 1e-3)
and in bfloat16 (within 3e-2, test_engine_cuda's bfloat16 tolerance), and 32 greedy tokens in float32 through the
default fast path; and the sliding windows shorter than the prompt, chunked across steps.

    python -m pytest -m cuda tests/gpu/test_model_families_cuda.py -ra      (on a GPU machine; skipped elsewhere)
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from tests.test_model_families import CONFIGS, _save
from tests.utils import CUDA_ONLY, hf_greedy, our_logits, relative_error
from tinyvllm import LLM, SamplingParams

pytestmark = CUDA_ONLY

ENGINE_ARGS = dict(skip_tokenizer_init=True, gpu_memory_utilization=0.2, max_model_len=512, max_num_seqs=8)


def _hf(path: str, family: str):
    import transformers

    # (eager attention: the one of transformers' implementations that applies Gemma 2's soft cap in every version)
    return getattr(transformers, f"{family}ForCausalLM").from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").cuda().eval()


def _free(llm: LLM) -> None:
    llm.llm_engine.shutdown()
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_greedy_tokens_match_transformers(tmp_path, name: str) -> None:
    family, config = CONFIGS[name]
    path = _save(str(tmp_path / name), family, seed=len(name), **config)
    hf = _hf(path, family)
    rng = random.Random(2)
    prompts = [[rng.randrange(256) for _ in range(length)] for length in (1, 9, 70)]
    with torch.inference_mode():
        refs = [hf(torch.tensor([ids], device="cuda")).logits[0].float().cpu() for ids in prompts]
    for dtype, tolerance in (("float32", 1e-3), ("bfloat16", 3e-2)):
        llm = LLM(path, dtype=dtype, **ENGINE_ARGS)
        for ids, ref in zip(prompts, refs):
            error = relative_error(our_logits(llm, ids).float().cpu(), ref)
            assert error < tolerance, (dtype, len(ids), error)
        if dtype == "float32":
            prompt = [5, 17, 99, 3, 42, 7, 200, 31]
            params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
            ours = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
            with torch.inference_mode():
                assert ours == hf_greedy(hf, prompt, 32)
        _free(llm)


@pytest.mark.parametrize("family,window", [("Mistral", dict(sliding_window=8)), (
    "Qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1))])
def test_sliding_windows_shorter_than_the_prompt_match_transformers(tmp_path, family: str, window: dict) -> None:
    path = _save(str(tmp_path / family), family, 4, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                 **window)
    hf = _hf(path, family)
    prompt = [(11 * j + 5) % 250 + 2 for j in range(40)]
    llm = LLM(path, dtype="float32", max_num_batched_tokens=16, **ENGINE_ARGS)
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt], device="cuda")).logits[0].float().cpu()
        assert relative_error(our_logits(llm, prompt).float().cpu(), ref) < 1e-3
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(hf, prompt, 16)
    _free(llm)
