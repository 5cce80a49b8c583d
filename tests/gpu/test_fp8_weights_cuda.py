"""FP8 weights (quantization="fp8") on a CUDA GPU, on the Llama-3.2-1B-shaped random-weight model: the logits
against transformers' float32 beside our bf16 weights' (the accuracy a float8 weight costs, printed), and greedy
generation through the CUDA graphs (the fp8 decode kernels at one row, _scaled_mm above) against eager.

    python -m pytest -m cuda tests/gpu/test_fp8_weights_cuda.py -ra -s      (on a GPU machine; skipped elsewhere)
"""

from __future__ import annotations

import gc

import pytest
import torch

from tests.utils import CUDA_ONLY, our_logits, random_llama_1b, relative_error
from tinyvllm import LLM, SamplingParams

pytestmark = CUDA_ONLY

ENGINE_ARGS = dict(skip_tokenizer_init=True, max_model_len=2048, gpu_memory_utilization=0.3, max_num_seqs=16,
                   max_num_batched_tokens=256)
IDS = [(k * 7919) % 10000 for k in range(200)]
PROMPTS = [[(i * 37 + j * 11) % 10000 for j in range(n)] for i, n in enumerate((5, 40, 130, 300))]


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    """transformers' float32 logits ("fp32"), and with each linear layer's weight but the LM head's rounded to float8
    per output channel and back ("fp8": what float8 weights cost by themselves, whoever runs them)."""
    from transformers import AutoModelForCausalLM

    from tinyvllm.ops.fp8 import quantize_fp8_weight

    hf = AutoModelForCausalLM.from_pretrained(random_llama_1b(), dtype=torch.float32).cuda().eval()
    logits = {}
    with torch.inference_mode():
        logits["fp32"] = hf(torch.tensor([IDS], device="cuda")).logits[0].float().cpu()
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                w8, scale = quantize_fp8_weight(module.weight)
                module.weight.copy_(w8.float() * scale[:, None])
        logits["fp8"] = hf(torch.tensor([IDS], device="cuda")).logits[0].float().cpu()
    del hf
    _free()
    return logits


def test_fp8_weights_logits_against_bf16_weights(reference: dict[str, torch.Tensor]) -> None:
    """Ours with float8 weights moves from transformers' float32 logits by no more than transformers' own with the
    same rounding of its weights (1.25x), plus what our bf16 run moves by itself."""
    errors, agreement = {}, {}
    ref = reference["fp32"]
    for quantization in (None, "fp8", "fp8+head"):
        llm = LLM(random_llama_1b(), dtype="bfloat16", enforce_eager=True, quantization=quantization and "fp8",
                  quantize_lm_head=quantization == "fp8+head", **ENGINE_ARGS)
        if quantization:
            qkv = llm.llm_engine.engine_core.model_runner.model.model.layers[0].self_attn.qkv_proj
            assert qkv.weight.dtype == torch.float8_e4m3fn
        ours = our_logits(llm, IDS).float().cpu()
        errors[quantization] = relative_error(ours, ref)
        agreement[quantization] = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
        llm.llm_engine.shutdown()
        del llm
        _free()
    rounded = relative_error(reference["fp8"], ref)
    rounded_top1 = (reference["fp8"].argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"\nlogits vs transformers fp32 over {len(IDS)} positions: ours with bf16 weights rel err {errors[None]:.3e} "
          f"(top-1 {agreement[None]:.1%}), ours with fp8 weights {errors['fp8']:.3e} (top-1 {agreement['fp8']:.1%}); "
          f"transformers fp32 with its weights rounded to fp8 {rounded:.3e} (top-1 {rounded_top1:.1%}); with the LM "
          f"head in fp8 too {errors['fp8+head']:.3e} (top-1 {agreement['fp8+head']:.1%})")
    assert errors["fp8"] <= 1.25 * rounded + errors[None]


@pytest.mark.parametrize("head", [False, True])
def test_fp8_weights_greedy_through_cuda_graphs_as_eager(head: bool) -> None:
    """head: the LM head in float8 too (quantize_lm_head: the fused LM-head argmax reads float8 rows)."""
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    runs = {}
    for eager in (False, True):
        llm = LLM(random_llama_1b(), quantization="fp8", quantize_lm_head=head, enforce_eager=eager, **ENGINE_ARGS)
        runs[eager] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        llm.llm_engine.shutdown()
        del llm
        _free()
    assert all(len(tokens) == 48 for tokens in runs[False])
    if runs[False] != runs[True]:
        same = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(*runs.values())]
        pytest.xfail(f"bf16 + fp8 greedy, graphs vs eager (a flip at a near-tie is expected): common prefixes {same}")
