"""The model's use of the fused decode kernels (ops.use_decode_kernel, RMSNorm.project, greedy_tokens and
ModelRunner.sample), on a tiny random Llama on the CPU: the CPU path never calls them and gives the tokens
it gave before; with the dispatch forced on, the Triton kernels (under the interpreter, float32) give the same
hidden states and greedy tokens as the separate ops."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.utils import count_gemv_launches, hf_greedy, hf_model, our_logits, tiny_llama_fixture, tiny_llm
from tinyvllm import SamplingParams, ops

checkpoint = tiny_llama_fixture(seed=15)
PROMPT = [3, 17, 42, 99, 5]
NUM_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


def _greedy(llm: Any) -> list[int]:
    return list(llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


def test_cpu_path_never_uses_the_decode_kernels(checkpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU no product asks for the decode kernels (each would raise here), greedy_tokens leaves the
    step to the logits and the sampler, and the tokens are transformers' greedy ones."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a decode kernel was called on the CPU")

    for name in ("fused_linear", "fused_norm_linear", "linear_argmax"):
        monkeypatch.setattr(ops, name, refuse)
    llm = tiny_llm(checkpoint, num_kv_blocks=32)
    model = llm.llm_engine.engine_core.model_runner.model
    assert model.greedy_tokens(torch.zeros(1, model.config.hidden_size)) is None
    assert _greedy(llm) == hf_greedy(hf_model(checkpoint), PROMPT, NUM_TOKENS)


@pytest.mark.parametrize("layout", ["input-major", "output-major"])
def test_forced_decode_kernels_match_the_separate_ops(checkpoint: str, monkeypatch: pytest.MonkeyPatch,
                                                      layout: str) -> None:
    """Every product on the fused kernels (the interpreter runs them on CPU tensors): the first layer's norm
    without a residual, the residual stream between layers, gate_up's SiLU·mul, o and down plain, and the greedy
    step through the LM head's argmax (ModelRunner.sample, with its rows padded as on CUDA too: three sequences on
    four rows) give the hidden states and tokens of the plain path. With the projections output-major, as the
    loader keeps them on CUDA for the decode kernels, the decode steps run them on the GEMV."""
    pytest.importorskip("triton")
    from tinyvllm.model.layers import Linear
    from tinyvllm.ops.fused_linear import fused_linear_triton, fused_norm_linear_triton, linear_argmax_triton

    llm = tiny_llm(checkpoint, num_kv_blocks=32)
    model = llm.llm_engine.engine_core.model_runner.model
    if layout == "output-major":
        for module in model.modules():
            if isinstance(module, Linear) and module.product:
                module.weight.data = module.weight.data.contiguous()
    gemv_calls = count_gemv_launches(monkeypatch)
    plain_logits = our_logits(llm, PROMPT)
    plain_tokens = _greedy(llm)
    plain_others = [list(o.outputs[0].token_ids) for o in llm.generate([PROMPT[:3], PROMPT[1:]], GREEDY,
                                                                       use_tqdm=False)]

    calls: list[str] = []

    def counted(name: str, kernel: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return kernel(*args, **kwargs)
        return run

    monkeypatch.setattr(ops, "use_decode_kernel", lambda product, x: True)
    monkeypatch.setattr(ops, "fused_linear", counted("fused_linear", fused_linear_triton))
    monkeypatch.setattr(ops, "fused_norm_linear", counted("fused_norm_linear", fused_norm_linear_triton))
    monkeypatch.setattr(ops, "linear_argmax", counted("linear_argmax", linear_argmax_triton))
    layers = model.config.num_layers
    fused_logits = our_logits(llm, PROMPT)
    assert sorted(calls) == ["fused_linear"] * 2 * layers + ["fused_norm_linear"] * 2 * layers
    assert not gemv_calls  # (5 tokens: more rows than the GEMV takes)
    torch.testing.assert_close(fused_logits, plain_logits, atol=1e-4, rtol=1e-4)
    with torch.inference_mode():
        hidden = torch.randn(3, model.config.hidden_size)
        assert torch.equal(model.greedy_tokens(hidden), model.compute_logits(hidden).argmax(-1))
    calls.clear()
    assert _greedy(llm) == plain_tokens
    assert calls.count("linear_argmax") == NUM_TOKENS  # every step's token from the LM head's argmax
    # The decode steps (one token each) on the GEMV where the weights are output-major: 4 products a layer.
    assert len(gemv_calls) == ((NUM_TOKENS - 1) * 4 * layers if layout == "output-major" else 0)
    llm.llm_engine.engine_core.model_runner.fixed_shapes = True  # (as on CUDA: the LM head's rows padded)
    assert [list(o.outputs[0].token_ids) for o in llm.generate([PROMPT, PROMPT[:3], PROMPT[1:]], GREEDY,
                                                               use_tqdm=False)] == [plain_tokens, *plain_others]
