"""FP8 weights on the CPU (the references: float8 weights dequantized per product): quantization="fp8" at load, and
float8 checkpoints as llm-compressor (compressed-tensors, scales per channel or per tensor) and quant_method "fp8"
write them, against transformers on the dequantized weights; tensor parallelism with the scales cut with their
weights; and the refusals (an unknown method, a scheme we do not load)."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.utils import our_logits, relative_error, save_tiny_llama
from tinyvllm import LLM, SamplingParams
from tinyvllm.config import ConfigError, QuantizationConfig
from tinyvllm.ops.fp8 import quantize_fp8_weight

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT = [(7 * j + 3) % 250 + 2 for j in range(40)]


def _hf_logits(path: str, ids: list[int], fp8: bool = False) -> torch.Tensor:
    """transformers' float32 logits; fp8: with each linear layer's weight (not the LM head's) quantized to float8 per
    output channel and back (the rounding quantization="fp8" makes, without our norm folding before it)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        for name, module in model.named_modules():
            if fp8 and isinstance(module, torch.nn.Linear) and name != "lm_head":
                w8, scale = quantize_fp8_weight(module.weight)
                module.weight.copy_(w8.float() * scale[:, None])
        return model(torch.tensor([ids])).logits[0].float()


def _fp8_checkpoint(src: str, dst: str, strategy: str, config: dict) -> str:
    """src's linear weights as float8 with their scales (per output channel, [N, 1], or one per tensor) in dst, with
    `config` as quantization_config; and dst + "-dequantized": the same weights dequantized, in float32, for
    transformers."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, tensor in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS:
            if strategy == "channel":
                w8, scale = quantize_fp8_weight(tensor)
                quantized[name.replace(".weight", ".weight_scale")] = scale[:, None]
                dequantized[name] = w8.float() * scale[:, None]
            else:
                scale = tensor.abs().max() / 448
                w8 = (tensor / scale).to(torch.float8_e4m3fn)
                quantized[name.replace(".weight", ".weight_scale")] = scale.reshape(1)
                quantized[name.replace(".weight", ".input_scale")] = torch.ones(1)  # (static: we quantize per token)
                dequantized[name] = w8.float() * scale
            quantized[name] = w8
        else:
            quantized[name] = dequantized[name] = tensor
    with open(os.path.join(src, "config.json")) as f:
        hf_config = json.load(f)
    for path, weights, extra in ((dst, quantized, {"quantization_config": config}),
                                 (dst + "-dequantized", dequantized, {})):
        os.makedirs(path, exist_ok=True)
        save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({**hf_config, **extra}, f)
    return dst


def compressed_tensors(strategy: str) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                                                      "symmetric": True, "dynamic": False},
                                          "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                                "dynamic": True}}}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny")), seed=5, tie_word_embeddings=False)


def test_quantization_fp8_stores_float8_weights_and_stays_near_the_model(tiny) -> None:
    llm = LLM(tiny, skip_tokenizer_init=True, device="cpu", num_kv_blocks=16, quantization="fp8")
    layer = llm.llm_engine.engine_core.model_runner.model.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert linear.weight.dtype == torch.float8_e4m3fn and linear.weight_scale.shape == (linear.weight.shape[0],)
    # e4m3 keeps 3 mantissa bits: the tiny random model's logits move by about a tenth whoever rounds its weights
    # so; ours (norms folded first, then rounded) must move no more than transformers' with the same rounding.
    ours, ref, rounded = our_logits(llm, PROMPT), _hf_logits(tiny, PROMPT), _hf_logits(tiny, PROMPT, fp8=True)
    assert relative_error(ours, ref) < 1.25 * relative_error(rounded, ref)
    agreement = [(logits.argmax(-1) == ref.argmax(-1)).float().mean() for logits in (ours, rounded)]
    assert agreement[0] >= agreement[1] - 0.1, agreement
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert len(llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids) == 16


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_compressed_tensors_checkpoints_match_transformers_on_the_dequantized_weights(tiny, tmp_path,
                                                                                      strategy: str) -> None:
    path = _fp8_checkpoint(tiny, str(tmp_path / strategy), strategy, compressed_tensors(strategy))
    llm = LLM(path, skip_tokenizer_init=True, device="cpu", num_kv_blocks=16)
    model = llm.llm_engine.engine_core.model_runner.model
    assert model.model.layers[1].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    assert model.lm_head.weight.dtype == torch.float32  # (the LM head is never quantized)
    assert not model.model.norms_folded  # (a float8 checkpoint's weights cannot take the norms)
    assert relative_error(our_logits(llm, PROMPT), _hf_logits(path + "-dequantized", PROMPT)) < 1e-4


def test_quant_method_fp8_checkpoints_load_with_per_tensor_scales(tiny, tmp_path) -> None:
    config = {"quant_method": "fp8", "activation_scheme": "static"}
    path = _fp8_checkpoint(tiny, str(tmp_path / "fp8"), "tensor", config)
    llm = LLM(path, skip_tokenizer_init=True, device="cpu", num_kv_blocks=16, quantization="fp8")
    qkv = llm.llm_engine.engine_core.model_runner.model.model.layers[0].self_attn.qkv_proj
    assert len(set(qkv.weight_scale.tolist())) == 3  # (q, k and v each keep their own tensor's scale)
    assert relative_error(our_logits(llm, PROMPT), _hf_logits(path + "-dequantized", PROMPT)) < 1e-4


def test_two_ranks_cut_the_scales_with_their_weights(tiny, tmp_path) -> None:
    path = _fp8_checkpoint(tiny, str(tmp_path / "tp"), "channel", compressed_tensors("channel"))
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 250) for _ in range(n)] for n in (5, 23)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    results = []
    for size in (1, 2):
        llm = LLM(path, skip_tokenizer_init=True, device="cpu", num_kv_blocks=16, tensor_parallel_size=size)
        results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.llm_engine.shutdown()
    assert results[0] == results[1]


def test_unknown_methods_and_schemes_are_refused_with_what_loads(tiny, tmp_path) -> None:
    with pytest.raises(ConfigError, match="quantization must be one of fp8"):
        LLM(tiny, skip_tokenizer_init=True, device="cpu", quantization="awq")
    with pytest.raises(ConfigError, match="quant_method 'gptq' is not supported"):
        QuantizationConfig.from_hf_dict({"quant_method": "gptq", "bits": 4})
    int4 = compressed_tensors("channel")
    int4["config_groups"]["group_0"]["weights"] = {"num_bits": 4, "type": "int", "strategy": "group"}
    with pytest.raises(ConfigError, match="8-bit float weights"):
        QuantizationConfig.from_hf_dict(int4)
    with pytest.raises(ConfigError, match="block-wise"):
        QuantizationConfig.from_hf_dict({"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert QuantizationConfig("fp8", ignore=("lm_head", "re:.*layers\\.0\\..*")).ignores("model.layers.0.mlp.down_proj")


@pytest.mark.parametrize("tied", [False, True])
def test_quantize_lm_head_keeps_the_head_in_float8_and_the_lookups_as_they_were(tmp_path, tied) -> None:
    """quantize_lm_head: the head's weight in float8 with a scale per vocabulary row; a tied model's lookups still
    read the embedding table in the model's dtype. The logits move no more than rounding the head's weight alone
    (after the other layers') moves transformers' logits, and greedy tokens mostly agree with the head unquantized."""
    path = save_tiny_llama(str(tmp_path), seed=6, tie_word_embeddings=tied)
    kwargs = dict(skip_tokenizer_init=True, device="cpu", num_kv_blocks=16, quantization="fp8")
    body = LLM(path, **kwargs)
    llm = LLM(path, quantize_lm_head=True, **kwargs)
    model = llm.llm_engine.engine_core.model_runner.model
    head, table = model.lm_head, model.get_input_embeddings()
    assert head.weight.dtype == torch.float8_e4m3fn and head.weight_scale.shape == (head.weight.shape[0],)
    assert table.weight.dtype == torch.float32
    ours, theirs, ref = our_logits(llm, PROMPT), our_logits(body, PROMPT), _hf_logits(path, PROMPT)
    w8, scale = quantize_fp8_weight(table.weight if tied else body.llm_engine.engine_core.model_runner.model.lm_head
                                    .weight)
    assert torch.equal(head.weight, w8) and torch.equal(head.weight_scale, scale)
    assert relative_error(ours, theirs) < 0.05  # (e4m3's 3 mantissa bits on the head alone: ~0.025 here)
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.8
    assert relative_error(ours, ref) < 1.25 * relative_error(theirs, ref)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert len(llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids) == 16
    with pytest.raises(ConfigError, match="quantize_lm_head needs float8 weights"):
        LLM(path, skip_tokenizer_init=True, device="cpu", quantize_lm_head=True)
