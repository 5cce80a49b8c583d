"""Our Llama forward pass against transformers' LlamaForCausalLM on small random-weight checkpoints."""

import os
import random

import pytest
import torch

from tests.utils import hf_greedy, hf_model, model_logits, our_logits, relative_error, save_tiny_llama
from tinyvllm import LLM, SamplingParams

CONFIGS = {
    "mha-tied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "gqa-untied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "gqa4-llama3-rope-sharded": dict(
        num_attention_heads=8, num_key_value_heads=2, hidden_size=128, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "odd-head-dim": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=24, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    shard = "60KB" if "sharded" in request.param else None
    save_tiny_llama(path, seed=len(request.param), max_shard_size=shard, **CONFIGS[request.param])
    return path


@pytest.fixture(scope="module")
def engines(checkpoint):
    llm = LLM(checkpoint, skip_tokenizer_init=True, device="cpu", num_kv_blocks=64)
    return llm, hf_model(checkpoint)


def test_checkpoint_is_sharded_when_asked(checkpoint):
    """The "sharded" case really loads from several files (an index), and the others from one."""
    files = sorted(f for f in os.listdir(checkpoint) if f.endswith(".safetensors"))
    if "sharded" in checkpoint:
        assert os.path.isfile(os.path.join(checkpoint, "model.safetensors.index.json")) and len(files) > 1, files
    else:
        assert files == ["model.safetensors"], files


def test_logits_match_transformers(engines):
    llm, hf = engines
    rng = random.Random(1)
    for length in (1, 7, 33, 150):
        ids = [rng.randrange(256) for _ in range(length)]
        ours = our_logits(llm, ids)
        with torch.inference_mode():
            ref = hf(torch.tensor([ids])).logits[0].float()
        assert relative_error(ours, ref) < 1e-4, length


def test_greedy_tokens_match_transformers(engines):
    llm, hf = engines
    prompt = [5, 17, 99, 3, 42, 7, 200, 31]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ours = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert ours == hf_greedy(hf, prompt, 32)


def test_each_layer_computes_attention_through_the_metadata_once(engines):
    """The piecewise CUDA graphs (worker/cuda_graphs.py) cut their capture where the model calls
    AttentionMetadata.attention: every layer must call it once, in order, and use what it returns."""
    from tinyvllm import ops

    llm, _ = engines
    layers = llm.llm_engine.engine_core.model_runner.model.model.layers
    calls = []

    def attention(q, k_cache, v_cache, meta, scale):
        calls.append(k_cache.data_ptr())
        return ops.paged_attention(q, k_cache, v_cache, meta, scale)

    ids = [5, 17, 99, 3, 42, 7, 200, 31, 8, 9]
    hooked = our_logits(llm, ids, attention)
    assert calls == [layer.self_attn.attn.k_cache.data_ptr() for layer in layers]
    assert torch.equal(hooked, our_logits(llm, ids))
    assert not torch.equal(hooked, our_logits(llm, ids, lambda q, *rest: torch.zeros_like(q)))


def test_folded_norms_match_the_norm_kernels(checkpoint):
    """The RMSNorm weights folded into qkv_proj and gate_up_proj (the default, LlamaForCausalLM.fold_norms: no norm
    kernel in the layers) give the logits of the plain model, loaded without the fold, whose norms run as ops."""
    from tinyvllm.config import ModelConfig
    from tinyvllm.model.checkpoint import iter_safetensors
    from tinyvllm.model.loader import build_model, load_weights
    from tinyvllm.model.registry import model_class
    from tinyvllm.worker.kv_cache import allocate_kv_cache

    ids = [5, 17, 99, 3, 42, 7, 200, 31, 8]
    config, cpu = ModelConfig.from_hf_dir(checkpoint), torch.device("cpu")
    folded = build_model(config, checkpoint, cpu, torch.float32, 64)
    plain = model_class(config.architecture)(config, 64)
    load_weights(plain, iter_safetensors(checkpoint))
    plain.rotary.build(cpu)
    assert folded.model.norms_folded and not plain.model.norms_folded
    for model in (folded, plain):
        allocate_kv_cache(model, 4, 16, torch.float32, cpu)
    assert relative_error(model_logits(folded, ids), model_logits(plain, ids)) < 1e-5


@pytest.mark.parametrize("dtype, folded", [(torch.bfloat16, True), (torch.float32, True), (torch.float16, False)])
def test_norms_fold_in_bfloat16_and_float32_only(checkpoint, dtype, folded):
    """float16 weights keep their norm kernels: the products of the unnormalized stream would come nearer float16's
    ceiling. The folded norms' weights are 1."""
    from tinyvllm.config import ModelConfig
    from tinyvllm.model.loader import build_model

    model = build_model(ModelConfig.from_hf_dir(checkpoint), checkpoint, torch.device("cpu"), dtype, 64)
    assert model.model.norms_folded == folded
    norm = model.model.layers[0].input_layernorm.weight
    assert bool((norm == 1).all()) == folded


def test_a_sliding_window_matches_transformers_mistral(tmp_path) -> None:
    """transformers' MistralForCausalLM with a window of 8 against our model over a 40-token prompt, its layers given
    the window (layers.Attention's sliding_window, set here on the built model): the logits of the prefill and 16
    greedy tokens (decode steps, each under the window). The window reaches an AttentionMetadata.attention hook as a
    keyword."""
    import transformers

    from tests.utils import TINY, draw_norm_weights
    from tinyvllm import ops

    torch.manual_seed(5)
    config = transformers.MistralConfig(**{**TINY, "tie_word_embeddings": False, "sliding_window": None})
    model = transformers.MistralForCausalLM(config)
    draw_norm_weights(model)
    model.save_pretrained(str(tmp_path))  # (without a window in its config: the Mistral family refuses one yet)
    hf = transformers.MistralForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32, sliding_window=8).eval()
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, device="cpu", num_kv_blocks=64)
    layers = [layer.self_attn.attn for layer in llm.llm_engine.engine_core.model_runner.model.model.layers]
    rng = random.Random(6)
    prompt = [rng.randrange(256) for _ in range(40)]
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    assert relative_error(our_logits(llm, prompt), ref) > 1e-2  # (the window matters here)
    for layer in layers:
        layer.sliding_window = 8
    assert relative_error(our_logits(llm, prompt), ref) < 1e-4
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(hf, prompt, 16)
    options = []

    def attention(q, k_cache, v_cache, meta, scale, **kwargs):
        options.append(kwargs)
        return ops.paged_attention(q, k_cache, v_cache, meta, scale, **kwargs)

    assert relative_error(our_logits(llm, prompt, attention), ref) < 1e-4
    assert options == [{"sliding_window": 8}] * len(layers)
