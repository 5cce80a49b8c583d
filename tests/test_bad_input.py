"""Each bad input is refused with a ValueError that says what is wrong, before any work starts, and
the engine serves the next good request as if nothing happened."""

import json
import os

import pytest

from tests.utils import save_tiny_llama
from tinyvllm import LLM, SamplingParams


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(n=0), "n must be"),
    (dict(min_p=2.0), "min_p"),
    (dict(logprobs=-1), "logprobs"),
    (dict(stop=[""]), "stop"),
    # what cannot fit the engine's dtypes, or costs out of proportion (issue: no request may kill the server)
    (dict(top_k=2**63), "top_k"),
    (dict(top_k=True), "top_k"),
    (dict(n=1.5), "n must be"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(seed=2**63), "seed"),
    (dict(seed=-2**63 - 1), "seed"),
    (dict(logprobs=21), "logprobs"),
    (dict(max_tokens=2.0), "max_tokens"),
    (dict(stop=["x"] * 65), "stop has 65"),
    (dict(stop="x" * 1025), "stop strings"),
    (dict(stop_token_ids=[1.0]), "stop_token_ids"),
    (dict(stop_token_ids=list(range(1025))), "stop_token_ids has"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def good_request_works(llm):
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    llm.llm_engine.engine_core.block_manager.check_whole()
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("prompt,params,message", [
    ("", SamplingParams(), "empty"),
    ([], SamplingParams(), "empty"),
    ([1, 2, 10**9], SamplingParams(), "token ids must be in"),
    ([1, 2.0], SamplingParams(), "list of token ids"),
    ([1, "2"], SamplingParams(), "list of token ids"),
    ([[1, 2]], SamplingParams(), "list of token ids"),
    ([2**70], SamplingParams(), "list of token ids"),
    ("Hi " * 300, SamplingParams(max_tokens=300), "beyond the model's context"),
    ("Hi", SamplingParams(max_tokens=10_000), "beyond the model's context"),
])
def test_bad_prompts_then_a_good_request(tiny_text_llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        tiny_text_llm.generate([prompt], params, use_tqdm=False)
    good_request_works(tiny_text_llm)


@pytest.mark.parametrize("params,message", [
    (SamplingParams(n=129), "at most 128 completions"),
    (SamplingParams(stop_token_ids=[49152]), "token ids must be in"),
    (SamplingParams(stop_token_ids=[-1]), "token ids must be in"),
    (SamplingParams(max_tokens=None, min_tokens=600), "lower min_tokens"),
])
def test_bounds_the_model_sets(tiny_text_llm, params, message):
    """What depends on the engine (its max_n, the vocabulary, the context) is the input processor's to check."""
    with pytest.raises(ValueError, match=message):
        tiny_text_llm.generate(["Hello"], params, use_tqdm=False)
    good_request_works(tiny_text_llm)


def test_tiny_temperature_is_greedy():
    """Below vLLM's 1e-5 a temperature samples as greedy: dividing logits by it would overflow float32."""
    assert SamplingParams(temperature=1e-300).greedy and not SamplingParams(temperature=1e-4).greedy


def test_one_bad_prompt_in_a_batch_leaves_nothing_behind(tiny_text_llm):
    with pytest.raises(ValueError, match="empty"):
        tiny_text_llm.generate(["fine", "also fine", ""], SamplingParams(max_tokens=4), use_tqdm=False)
    good_request_works(tiny_text_llm)


def test_request_larger_than_the_whole_kv_cache(tiny_text_checkpoint):
    llm = LLM(tiny_text_checkpoint, device="cpu", num_kv_blocks=2)
    with pytest.raises(ValueError, match="KV cache"):
        llm.generate(["Hello"], SamplingParams(max_tokens=100), use_tqdm=False)
    good_request_works(llm)


def test_unknown_model_path():
    with pytest.raises(ValueError, match="does not exist"):
        LLM("/no/such/model")


def test_model_dir_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 8,
                                                      "hidden_size": 8, "intermediate_size": 8,
                                                      "num_hidden_layers": 1, "num_attention_heads": 2}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ValueError, match="never loads"):
        LLM(str(tmp_path), skip_tokenizer_init=True, device="cpu")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="not supported.*LlamaForCausalLM"):
        LLM(str(tmp_path), skip_tokenizer_init=True, device="cpu")


def test_corrupt_safetensors(tmp_path):
    path = save_tiny_llama(str(tmp_path / "m"), seed=1)
    with open(os.path.join(path, "model.safetensors"), "r+b") as f:
        f.seek(0)
        f.write(b"\xff" * 64)
    with pytest.raises(ValueError, match="not a valid safetensors"):
        LLM(path, skip_tokenizer_init=True, device="cpu")


def test_tensor_of_the_wrong_shape(tmp_path):
    path = save_tiny_llama(str(tmp_path / "m"), seed=1)
    config_path = os.path.join(path, "config.json")
    config = json.load(open(config_path))
    config["intermediate_size"] = 96
    json.dump(config, open(config_path, "w"))
    with pytest.raises(ValueError, match="shape"):
        LLM(path, skip_tokenizer_init=True, device="cpu")


def test_missing_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    path = save_tiny_llama(str(tmp_path / "m"), seed=1)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks tensors.*layers.1.mlp.down_proj"):
        LLM(path, skip_tokenizer_init=True, device="cpu")


def test_unsupported_gguf_quantization(tmp_path):
    import gguf
    import numpy as np

    from tinyvllm.model.gguf_loader import SUPPORTED_QUANT_TYPES, iter_gguf_tensors

    path = str(tmp_path / "m.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    qtype = next(t for t in (gguf.GGMLQuantizationType.IQ4_NL, gguf.GGMLQuantizationType.TQ1_0)
                 if t.name not in SUPPORTED_QUANT_TYPES)
    raw = np.zeros((4, gguf.GGML_QUANT_SIZES[qtype][1] * 8), dtype=np.uint8)
    writer.add_tensor("token_embd.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=f"{qtype.name}.*cannot read"):
        list(iter_gguf_tensors(path, None))
