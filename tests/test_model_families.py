"""The families beside Llama (Qwen2, Qwen3, Mistral, Gemma 2) against transformers' own classes on random-weight
configs unlike each other (head dims 64 and 128, GQA and MHA, tied and untied embeddings, a head_dim apart from
hidden / heads): float32 logits within 1e-4 over a prefill, 32 greedy tokens identical, and the logprobs of sampled
and prompt tokens as transformers' log-softmax; and sliding windows shorter than the prompt. Gemma 2's configs set
both soft caps low enough to bite on random weights, a query_pre_attn_scalar apart from head_dim and a window
shorter than the prompts, so its alternation of sliding and full layers matters."""

from __future__ import annotations

import random

import pytest
import torch

from tests.utils import FAMILY_BASE, HF_ARGS, hf_greedy, our_logits, random_model, relative_error
from tinyvllm import LLM, SamplingParams
from tinyvllm.config import ConfigError

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
    "gemma2-gqa-tied-hd64": ("Gemma2", dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                            head_dim=64, tie_word_embeddings=True, query_pre_attn_scalar=48,
                                            sliding_window=8, attn_logit_softcapping=5.0,
                                            final_logit_softcapping=3.0)),
    "gemma2-mha-untied-hd128": ("Gemma2", dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=2,
                                               head_dim=128, tie_word_embeddings=False, query_pre_attn_scalar=100,
                                               sliding_window=16, attn_logit_softcapping=8.0,
                                               final_logit_softcapping=4.0)),
}
# Gemma 2 in the checks of one shape below: caps and a window that bite, a head_dim apart from hidden / heads
GEMMA2 = dict(head_dim=48, query_pre_attn_scalar=40, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)


def _save(path: str, family: str, seed: int, **config: object) -> str:
    random_model(family, seed, **{**FAMILY_BASE, **config}).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=list(CONFIGS))
def family(request, tmp_path_factory) -> tuple[LLM, object]:
    import transformers

    name, config = CONFIGS[request.param]
    path = _save(str(tmp_path_factory.mktemp(request.param)), name, seed=len(request.param), **config)
    hf = getattr(transformers, f"{name}ForCausalLM").from_pretrained(path, **HF_ARGS).eval()
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


def test_logprobs_match_transformers(family) -> None:
    """The logprobs of the sampled tokens and of the prompt's (each logits path: Gemma 2's final soft cap in each)
    are transformers' log-softmax of its logits, a 20-token prompt then 6 greedy tokens."""
    llm, hf = family
    prompt = [(13 * j + 3) % 250 + 2 for j in range(20)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    output = llm.generate([prompt], params, use_tqdm=False)[0]
    tokens = output.outputs[0].token_ids
    ids = prompt + tokens
    with torch.inference_mode():
        expected = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert output.prompt_logprobs[0] is None
    for position in range(1, len(ids)):
        entry = (output.prompt_logprobs[position] if position < len(prompt)
                 else output.outputs[0].logprobs[position - len(prompt)])
        token = ids[position]
        assert abs(entry[token].logprob - expected[position - 1, token].item()) < 1e-4, position


@pytest.mark.parametrize("family_name,config", [("Qwen2", {}), ("Qwen3", {}), ("Gemma2", dict(GEMMA2,
                                                                                              sliding_window=8))])
def test_two_ranks_chunks_and_async_scheduling_give_the_same_tokens(tmp_path, family_name: str, config: dict) -> None:
    """Tensor parallelism (each rank its heads: Qwen2's biases and Qwen3's q/k norms split or shared alike, Gemma 2's
    logits capped after the ranks' vocabulary slices are gathered), chunked prefill beside decodes (across Gemma 2's
    window) and async scheduling: one rank's greedy tokens, and for Gemma 2 transformers' too."""
    path = _save(str(tmp_path / family_name), family_name, 3, hidden_size=128, num_attention_heads=4,
                 num_key_value_heads=2, **config)
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
    if family_name == "Gemma2":
        import transformers

        hf = transformers.Gemma2ForCausalLM.from_pretrained(path, **HF_ARGS).eval()
        assert results[0] == [hf_greedy(hf, prompt, 12) for prompt in prompts]


@pytest.mark.parametrize("family_name,window,windows", [
    ("Mistral", dict(sliding_window=8), [8, 8]),
    ("Qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), [None, 8]),
    ("Gemma2", dict(GEMMA2, sliding_window=8, num_hidden_layers=3), [8, None, 8]),
    ("Gemma2", dict(GEMMA2, sliding_window=8, num_hidden_layers=3,
                    layer_types=["full_attention", "sliding_attention", "sliding_attention"]), [None, 8, 8]),
])
def test_sliding_windows_shorter_than_the_prompt_match_transformers(tmp_path, family_name: str, window: dict,
                                                                     windows: list) -> None:
    """A window of 8 tokens under a 40-token prompt: in every layer (Mistral), from max_window_layers on (Qwen2:
    its first layer sees the whole context), in the even layers or those its layer_types name (Gemma 2); logits
    within 1e-4 and greedy tokens as transformers'."""
    import transformers

    path = _save(str(tmp_path / family_name), family_name, 4, hidden_size=128, num_attention_heads=2,
                 num_key_value_heads=1, **window)
    hf = getattr(transformers, f"{family_name}ForCausalLM").from_pretrained(path, **HF_ARGS).eval()
    llm = LLM(path, skip_tokenizer_init=True, device="cpu", num_kv_blocks=32, max_num_batched_tokens=16)
    layers = llm.llm_engine.engine_core.model_runner.model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == windows
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


def test_a_gemma2_config_json_without_its_optional_fields_reads_as_transformers_does() -> None:
    """Gemma 2's checkpoints leave out tie_word_embeddings (and may leave out more): what they leave out takes
    transformers' Gemma2Config defaults, not Llama's (tied embeddings, head_dim 256, the soft caps, the window on
    the even layers, query_pre_attn_scalar 256); and an activation other than GELU-tanh is refused."""
    import transformers

    from tinyvllm.config import ModelConfig
    from tinyvllm.model.gemma2 import Gemma2ForCausalLM

    fields = dict(architectures=["Gemma2ForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=2)
    config, hf = ModelConfig.from_hf_dict(fields), transformers.Gemma2Config(**fields)
    assert (config.tie_word_embeddings, config.head_dim, config.rms_norm_eps, config.max_position_embeddings) == (
        hf.tie_word_embeddings, hf.head_dim, hf.rms_norm_eps, hf.max_position_embeddings)
    model = Gemma2ForCausalLM(config, max_positions=64)
    assert model.lm_head is None and model.final_logit_softcap == hf.final_logit_softcapping
    attention = [layer.self_attn.attn for layer in model.model.layers]
    assert [a.sliding_window for a in attention] == [
        hf.sliding_window if kind == "sliding_attention" else None for kind in hf.layer_types]
    assert [a.logit_softcap for a in attention] == [hf.attn_logit_softcapping] * 2
    assert attention[0].scale == hf.query_pre_attn_scalar**-0.5
    with pytest.raises(ConfigError, match="gelu_pytorch_tanh"):
        Gemma2ForCausalLM(ModelConfig.from_hf_dict({**fields, "hidden_activation": "relu"}), max_positions=64)


def test_gemma_norm_loads_one_plus_w_and_folds_as_llamas() -> None:
    """GemmaRMSNorm holds 1 + w (float32, whatever the model's dtype), so the shared norm op gives transformers'
    Gemma2RMSNorm, and RMSNorm.fold_into, which folds the weight it holds, stays exact for it."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    from tinyvllm.model.gemma2 import GemmaRMSNorm
    from tinyvllm.model.layers import Linear

    torch.manual_seed(5)
    reference = Gemma2RMSNorm(96, eps=1e-6)
    with torch.no_grad():
        reference.weight.normal_(0, 0.5)
    for dtype in (torch.float32, torch.bfloat16):
        norm = GemmaRMSNorm(96, 1e-6)
        norm.weight.weight_loader(norm.weight, reference.weight.detach().to(dtype))
        assert norm.weight.dtype == torch.float32
        x = torch.randn(5, 96).to(dtype)
        torch.testing.assert_close(norm(x)[0], reference.to(dtype)(x), atol=0, rtol=0)
    linear = Linear(96, 32)
    linear.weight.data = torch.randn(32, 96)
    x = torch.randn(5, 96)
    unfolded = linear(norm(x)[0])
    norm.fold_into(linear)
    torch.testing.assert_close(linear(norm(x)[0]), unfolded, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fp8_weights_in_every_family(tmp_path, name: str) -> None:
    """quantization="fp8" in each family (biases, per-head q/k norms, Gemma 2's four norms and GELU gate): the linear
    layers hold float8 weights, and the logits move from transformers' float32 by no more than transformers' own
    with each linear weight (not the LM head's) rounded to float8 per output channel (1.25x: ours rounds the weights
    after folding the norms, where a family folds them); where nothing is folded, they are those logits."""
    import transformers

    from tinyvllm.ops.fp8 import quantize_fp8_weight

    family, config = CONFIGS[name]
    path = _save(str(tmp_path / name), family, seed=len(name), **config)
    hf = getattr(transformers, f"{family}ForCausalLM").from_pretrained(path, **HF_ARGS).eval()
    ids = [(13 * j + 7) % 250 + 2 for j in range(40)]
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
        for module_name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and module_name != "lm_head":
                w8, scale = quantize_fp8_weight(module.weight)
                module.weight.copy_(w8.float() * scale[:, None])
        rounded = hf(torch.tensor([ids])).logits[0].float()
    llm = LLM(path, skip_tokenizer_init=True, device="cpu", num_kv_blocks=16, quantization="fp8")
    layer = llm.llm_engine.engine_core.model_runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == layer.mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    ours = our_logits(llm, ids)
    assert relative_error(ours, ref) <= 1.25 * relative_error(rounded, ref) + 1e-5
    if not getattr(llm.llm_engine.engine_core.model_runner.model.model, "norms_folded", False):
        assert relative_error(ours, rounded) < 1e-4  # (the same weights rounded the same way: the same logits)
