"""GGUF files of the families beside Llama, written as llama.cpp's converter writes them (tests/utils.convert_to_gguf)
from random-weight transformers models: qwen2 (biases), qwen3 (per-head q/k norms), gemma2 (norms stored as 1 + w,
soft caps that bite, a window shorter than the prompt, tied embeddings) and Mistral, which llama.cpp writes as llama
(Q and K rows permuted). Float32 logits within 1e-4 of transformers' on the same weights over a prefill and 16
greedy tokens identical; Q8_0 files of non-llama architectures in their own types on the CPU against the same files
dequantized; Gemma 2's query_pre_attn_scalar by llama.cpp's rule (the file does not hold it)."""

from __future__ import annotations

import gguf
import pytest
import torch

from tests.utils import FAMILY_BASE, HF_ARGS, convert_to_gguf, hf_greedy, our_logits, random_model, relative_error
from tinyvllm import LLM, SamplingParams
from tinyvllm.model.quantization import GGUFInt4LinearMethod

# name -> (transformers family, its config over FAMILY_BASE, the class the GGUF loads as)
CONFIGS = {
    "qwen2": ("Qwen2", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                            rope_theta=50000.0)),
    "qwen3": ("Qwen3", dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                            tie_word_embeddings=False)),
    "gemma2": ("Gemma2", dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=48,
                              query_pre_attn_scalar=48, sliding_window=8, attn_logit_softcapping=5.0,
                              final_logit_softcapping=3.0)),
    "mistral": ("Mistral", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, sliding_window=None,
                                tie_word_embeddings=False)),
}
LOADS_AS = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
            "mistral": "LlamaForCausalLM"}
PROMPT = [(11 * j + 5) % 250 + 2 for j in range(40)]


def _write(tmp_path, name: str, qtype: str = "F32") -> tuple[str, str]:
    """(the safetensors directory, its GGUF) of CONFIGS[name]."""
    family, config = CONFIGS[name]
    model_dir = str(tmp_path / name)
    random_model(family, len(name), **{**FAMILY_BASE, **config}).save_pretrained(model_dir)
    return model_dir, convert_to_gguf(model_dir, str(tmp_path / f"{name}.{qtype}.gguf"), qtype)


def _llm(path: str, **kwargs: object) -> LLM:
    return LLM(path, skip_tokenizer_init=True, device="cpu", num_kv_blocks=16, **kwargs)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_gguf_matches_transformers_on_the_same_weights(tmp_path, monkeypatch, name: str) -> None:
    import transformers

    monkeypatch.setenv("TINYVLLM_CACHE_DIR", str(tmp_path / "cache"))
    model_dir, path = _write(tmp_path, name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, **HF_ARGS).eval()
    llm = _llm(path, dtype="float32")
    model = llm.llm_engine.engine_core.model_runner.model
    assert type(model).__name__ == LOADS_AS[name]
    if name == "gemma2":
        assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [8, None]
    with torch.inference_mode():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
    assert relative_error(our_logits(llm, PROMPT), ref) < 1e-4
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(hf, PROMPT, 16)


@pytest.mark.parametrize("name", ["qwen2", "gemma2"])
def test_a_q8_0_gguf_in_its_own_types_matches_it_dequantized(tmp_path, monkeypatch, name: str) -> None:
    """Q8_0 projections (Qwen2's with their float biases) and a tied Q8_0 table kept as int8 on the CPU (dtype auto):
    logits within bfloat16's rounding of the same file dequantized to float32."""
    monkeypatch.setenv("TINYVLLM_CACHE_DIR", str(tmp_path / "cache"))
    _, path = _write(tmp_path, name, "Q8_0")
    kept, reference = _llm(path), _llm(path, dtype="float32")
    model = kept.llm_engine.engine_core.model_runner.model
    layer = model.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(linear.method, GGUFInt4LinearMethod) and linear.method.bits == 8
    assert model.model.embed_tokens.method.bits == 8
    ours, theirs = our_logits(kept, PROMPT), our_logits(reference, PROMPT)
    assert relative_error(ours, theirs) < 3e-2
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.8


@pytest.mark.parametrize("layers,scalar", [(2, 48), (46, 64 // 2)])
def test_gemma2_query_pre_attn_scalar_is_llama_cpps(tmp_path, monkeypatch, layers: int, scalar: int) -> None:
    """The GGUF holds no query_pre_attn_scalar: llama.cpp scales by head_dim, save at 27B (46 layers), where it takes
    hidden / heads (Gemma 2 27B's config: 4608 / 32 = 144, not its head_dim of 128)."""
    from tinyvllm.model.loader import load_model_config

    monkeypatch.setenv("TINYVLLM_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tmp_path / "gemma2.gguf")
    writer = gguf.GGUFWriter(path, "gemma2")
    writer.add_block_count(layers)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(2)
    writer.add_key_length(48)
    writer.add_value_length(48)
    writer.add_vocab_size(256)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert load_model_config(path).hf_config["query_pre_attn_scalar"] == scalar
