"""GGUF weights kept quantized on the CPU (issue 52): each kept type's 4-bit groups against gguf's own
dequantization, torch's int4 product against its dequantized reference, a small GGUF loaded in its own types
against the same file dequantized (and no conversion cache written for it), the CPU's default KV pool, and the
embedded model's greedy output against the float32 path."""

import os

import gguf
import numpy as np
import pytest
import torch

from tinyvllm.config import QuantizationConfig
from tinyvllm.model.gguf_loader import gguf_cache_dir, int4_groups, int8_groups
from tinyvllm.model.layers import Linear
from tinyvllm.model.quantization import INT4_GROUP, REFINED_LOGITS, GGUFInt4LinearMethod
from tinyvllm.ops import AttentionMetadata
from tinyvllm.worker.kv_cache import allocate_kv_cache, cpu_default_blocks

Q = gguf.GGMLQuantizationType


def random_q4_k(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Raw Q4_K blocks (gguf cannot quantize to it): random values, scales and mins, valid float16 d and dmin."""
    blocks = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    blocks[..., 0:4] = rng.uniform(1e-3, 2e-2, (rows, cols // 256, 2)).astype(np.float16).view(np.uint8).reshape(
        rows, cols // 256, 4)
    return blocks.reshape(rows, -1)


def raw_tensor(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    if qtype == "Q4_K":
        return random_q4_k(rows, cols, rng)
    return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), getattr(Q, qtype))


def dequantized(raw: np.ndarray, qtype: str, rows: int, cols: int) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf.quants.dequantize(raw, getattr(Q, qtype)), np.float32).reshape(rows, cols))


def kept_layer(qtype: str, raw: np.ndarray, rows: int, cols: int, lookups: bool = False) -> Linear:
    """A Linear in GGUFInt4LinearMethod holding `raw`, loaded and packed as the loader does it (lookups: a tied
    Q8_0 table, which is the LM head)."""
    layer = Linear(cols, rows)
    bits = 8 if qtype == "Q8_0" else 4
    GGUFInt4LinearMethod(bits, lookups).create_weights(layer)
    values, scales = (int8_groups if bits == 8 else int4_groups)(raw, qtype, (rows, cols))
    layer.weight.data.copy_(torch.from_numpy(values))
    layer.weight_scale.data.copy_(torch.from_numpy(scales))
    layer.method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_4bit_groups_are_ggufs_own_dequantization(qtype):
    """w = (q - 8) * scale + zero over int4_groups' values and scales is gguf's dequantization, to float32's
    rounding."""
    rng = np.random.default_rng(0)
    rows, cols = 32, 512
    raw = raw_tensor(qtype, rows, cols, rng)
    values, scale_zero = int4_groups(raw, qtype, (rows, cols))
    groups = torch.from_numpy(values).view(rows, cols // 32, 16)
    q = torch.cat([groups & 0x0F, groups >> 4], dim=-1).float()
    scale_zero = torch.from_numpy(scale_zero)
    w = ((q - 8) * scale_zero[..., :1] + scale_zero[..., 1:]).view(rows, cols)
    reference = dequantized(raw, qtype, rows, cols)
    torch.testing.assert_close(w, reference, rtol=1e-6, atol=1e-6 * reference.abs().max().item())


def test_8bit_groups_are_ggufs_own_dequantization():
    rng = np.random.default_rng(1)
    raw = raw_tensor("Q8_0", 16, 256, rng)
    values, scales = int8_groups(raw, "Q8_0", (16, 256))
    w = torch.from_numpy(values).float().view(16, 8, 32) * torch.from_numpy(scales)[..., None]
    assert torch.equal(w.view(16, 256), dequantized(raw, "Q8_0", 16, 256))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K", "Q8_0"])
def test_the_int4_product_is_its_dequantized_reference(qtype):
    """torch's int4 kernel on the packed layer = bfloat16 x times the file's weights with their scales (and zeros)
    rounded to bfloat16, summed in float32: equal up to the result's bfloat16 rounding. And within bfloat16's
    rounding of the scales of the product with the file's exact weights."""
    rng = np.random.default_rng(2)
    rows, cols = 96, 512
    raw = raw_tensor(qtype, rows, cols, rng)
    layer = kept_layer(qtype, raw, rows, cols)
    x = torch.randn(5, cols)
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (5, rows)
    # the reference: the layer's own bfloat16 scales and zeros over its 4-bit values
    scale_zero = layer.weight_scale.float().transpose(0, 1)  # [rows, inputs / 32, 2]
    if qtype == "Q8_0":
        values, _ = int8_groups(raw, qtype, (rows, cols))
        q = torch.from_numpy(values).int()
        q = torch.cat([(q >> 4) + 8, q & 0x0F], dim=1).float()
        xq = torch.cat([x, x], dim=1)
    else:
        values, _ = int4_groups(raw, qtype, (rows, cols))
        groups = torch.from_numpy(values).view(rows, -1, 16)
        q = torch.cat([groups & 0x0F, groups >> 4], dim=-1).float().view(rows, -1)
        xq = x
    w = ((q.view(rows, -1, INT4_GROUP) - 8) * scale_zero[..., :1] + scale_zero[..., 1:]).view(rows, -1)
    reference = xq.bfloat16().float() @ w.t()
    torch.testing.assert_close(y, reference.bfloat16().float(), rtol=2**-7, atol=1e-3 * reference.abs().max().item())
    exact = x.bfloat16().float() @ dequantized(raw, qtype, rows, cols).t()
    torch.testing.assert_close(y, exact, rtol=0.02, atol=0.01 * exact.abs().max().item())


def test_a_tied_q8_0_heads_largest_logits_are_float32_products():
    """The 4-bit kernel's logits are bfloat16 (8 significant bits); an LM head kept as a tied Q8_0 table recomputes
    the REFINED_LOGITS largest of each row from its exact rows: there they are float32 products with the
    dequantized table, where the kernel's own are not; the others keep its rounding. 70 rows: two chunks."""
    rng = np.random.default_rng(5)
    vocab, hidden = 512, 256
    raw = raw_tensor("Q8_0", vocab, hidden, rng)
    head = kept_layer("Q8_0", raw, vocab, hidden, lookups=True)
    x = 4 * torch.randn(70, hidden)
    logits, exact = head(x), x @ dequantized(raw, "Q8_0", vocab, hidden).t()
    top = exact.topk(8).indices
    torch.testing.assert_close(logits.gather(1, top), exact.gather(1, top), rtol=1e-6, atol=1e-5)
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    rounded = head.method.product(head, x).float()
    assert not torch.allclose(rounded.gather(1, top), exact.gather(1, top), rtol=1e-4, atol=1e-3)
    scale = exact.abs().max().item()
    torch.testing.assert_close(logits, exact, rtol=2**-7, atol=0.01 * scale)
    assert REFINED_LOGITS < vocab


def write_tiny_gguf(path: str, types: dict[str, str]) -> None:
    """A one-layer Llama GGUF (hidden 256, 4 heads of 64, 2 KV heads, MLP 512, vocabulary 256, tied embeddings)
    with each projection in the type `types` gives it (by GGUF name), the norms F32."""
    rng = np.random.default_rng(3)
    hidden, inter, vocab = 256, 512, 256
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab)
    shapes = {"token_embd.weight": (vocab, hidden), "blk.0.attn_q.weight": (hidden, hidden),
              "blk.0.attn_k.weight": (128, hidden), "blk.0.attn_v.weight": (128, hidden),
              "blk.0.attn_output.weight": (hidden, hidden), "blk.0.ffn_gate.weight": (inter, hidden),
              "blk.0.ffn_up.weight": (inter, hidden), "blk.0.ffn_down.weight": (hidden, inter)}
    for name, (rows, cols) in shapes.items():
        qtype = types[name]
        raw = raw_tensor(qtype, rows, cols, rng)
        if qtype != "Q4_K":  # (random Q4_K scales are larger: keep the activations in range)
            raw = gguf.quants.quantize(0.05 * gguf.quants.dequantize(raw, getattr(Q, qtype)).reshape(rows, cols),
                                       getattr(Q, qtype))
        writer.add_tensor(name, raw, raw_dtype=getattr(Q, qtype))
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def prefill_logits(model, ids: list[int]) -> torch.Tensor:
    n = len(ids)
    allocate_kv_cache(model, 4, 16, torch.float32, torch.device("cpu"))
    meta = AttentionMetadata(torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                             torch.arange(4, dtype=torch.int32)[None], torch.arange(n), n, n)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n), meta))


def test_a_gguf_in_its_own_types_matches_it_dequantized_and_writes_no_cache(tmp_path, monkeypatch):
    """Q, K and V of three 4-bit types in one merged layer (Q and K un-permuted as 4-bit rows), Q4_K and Q4_1
    elsewhere, a Q5_0 projection widened to bfloat16, a tied Q8_0 table (exact lookups, the head as two 4-bit
    halves): logits within bfloat16's rounding of the dequantized float32 model's; no conversion cache."""
    from tinyvllm.model.loader import build_model, load_model_config
    from tinyvllm.model.quantization import GGUFBf16LinearMethod

    monkeypatch.setenv("TINYVLLM_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(path, {"token_embd.weight": "Q8_0", "blk.0.attn_q.weight": "Q4_0", "blk.0.attn_k.weight": "Q4_1",
                           "blk.0.attn_v.weight": "Q4_K", "blk.0.attn_output.weight": "Q4_1",
                           "blk.0.ffn_gate.weight": "Q4_K", "blk.0.ffn_up.weight": "Q4_K",
                           "blk.0.ffn_down.weight": "Q5_0"})
    config = load_model_config(path)
    cpu = torch.device("cpu")
    kept = build_model(config, path, cpu, torch.float32, 256, quantization=QuantizationConfig("gguf"))
    assert not os.path.exists(os.path.join(gguf_cache_dir(path), "model.safetensors"))
    layer = kept.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.method, GGUFInt4LinearMethod)
    assert isinstance(layer.mlp.gate_up_proj.method, GGUFInt4LinearMethod)
    assert isinstance(layer.mlp.down_proj.method, GGUFBf16LinearMethod)
    assert kept.model.embed_tokens.method.bits == 8 and kept.model.norms_folded
    reference = build_model(config, path, cpu, torch.float32, 256)
    assert os.path.exists(os.path.join(gguf_cache_dir(path), "model.safetensors"))  # (the dequantized path's)
    ids = [3, 17, 200, 5, 99, 42, 7, 128, 255, 0]
    assert torch.equal(kept.model.embed_tokens(torch.tensor(ids)), reference.model.embed_tokens.weight[ids])
    ours, theirs = prefill_logits(kept, ids), prefill_logits(reference, ids)
    scale = theirs.abs().max().item()
    torch.testing.assert_close(ours, theirs, rtol=0.03, atol=0.03 * scale)
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.8


def test_the_cpu_default_pool_holds_a_whole_context_and_a_block_per_other_sequence():
    # 8192-token context, 16-token blocks: 512 blocks for one sequence, one more for each of 255 others
    assert cpu_default_blocks(256, 512, 16, 8192) == 512 + 255
    assert cpu_default_blocks(1, 512, 16, 8192) == 512
    # a step's tokens beyond the context: the step must fit
    assert cpu_default_blocks(4, 8, 16, 1024) == 64 + 3


@pytest.mark.slow
def test_embedded_model_greedy_matches_the_float32_path():
    """The embedded model (Q4_1 projections, a tied Q8_0 table) in its own types against the same file
    dequantized to float32: the first 32 greedy tokens of several prompts equal, except where the float32 path's
    top two tokens are within 0.2 nats (a near tie that bfloat16 activations may flip), reported."""
    from tinyvllm import LLM, SamplingParams

    kept, reference = LLM(device="cpu"), LLM(device="cpu", dtype="float32")
    assert kept.llm_engine.engine_core.model_runner.model.model.embed_tokens.method.bits == 8
    prompts = [kept.apply_chat_template([{"role": "user", "content": q}]) for q in
               ("What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
                "Explain gravity to a child in two sentences.", "What does a CPU do?", "Who wrote Hamlet?")]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    ours = kept.generate(prompts, params, use_tqdm=False)
    theirs = reference.generate(prompts, params, use_tqdm=False)
    near_ties = []
    for a, b in zip(ours, theirs):
        a, b = a.outputs[0], b.outputs[0]
        if a.token_ids == b.token_ids:
            continue
        i = next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
        top = sorted(b.logprobs[i].values(), key=lambda lp: -getattr(lp, "logprob", lp))[:2]
        margin = abs(getattr(top[0], "logprob", top[0]) - getattr(top[1], "logprob", top[1]))
        near_ties.append((i, margin))
        assert margin < 0.2, f"token {i} differs with a float32 margin of {margin:.3f} nats: {a.text!r} / {b.text!r}"
    print(f"near ties: {near_ties}")
    assert len(near_ties) <= len(prompts) // 2
