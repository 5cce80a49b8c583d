"""Check every Triton kernel against its PyTorch reference on a GPU, at real shapes (Llama-3.2-1B: hidden
2048, 32 query / 8 KV heads of dim 64, MLP 8192, vocabulary 128256, block size 16), in bfloat16 and
float32. The reference runs in float32 on the same (rounded) inputs; the error printed is
||out - ref|| / ||ref||, against 1e-2 for bfloat16 and 1e-5 for float32. Exits 1 on any failure.

    python tests/gpu/check_kernels.py [--quick]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from common import attention_metadata  # noqa: E402

from tinyvllm.ops.activation import silu_and_mul_ref, silu_and_mul_triton  # noqa: E402
from tinyvllm.ops.attention import (  # noqa: E402
    AttentionMetadata,
    paged_attention_ref,
    paged_attention_triton,
)
from tinyvllm.ops.embedding import embedding_ref, embedding_triton  # noqa: E402
from tinyvllm.ops.kv_cache import store_kv_ref, store_kv_triton  # noqa: E402
from tinyvllm.ops.layernorm import (  # noqa: E402
    fused_add_rms_norm_ref,
    fused_add_rms_norm_triton,
    rms_norm_ref,
    rms_norm_triton,
)
from tinyvllm.ops.rotary import (  # noqa: E402
    build_cos_sin_cache,
    rotary_embedding_and_store_ref,
    rotary_embedding_and_store_triton,
    rotary_embedding_ref,
    rotary_embedding_triton,
)
from tinyvllm.ops.sampling import sample_triton  # noqa: E402

DEVICE = torch.device("cuda")
HIDDEN, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB, BLOCK_SIZE = 2048, 32, 8, 64, 8192, 128256, 16
LLAMA3_SCALING = {
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-5}
DTYPES = [torch.bfloat16, torch.float32]

failures: list[str] = []
_real_empty = torch.empty


def _poisoned_empty(*args, **kwargs) -> torch.Tensor:
    """torch.empty whose memory is NaN (floats) or -1 (integers), so that an unwritten output shows."""
    t = _real_empty(*args, **kwargs)
    return t.fill_(float("nan") if t.is_floating_point() else -1)


def poisoned(fn: Callable, *args):
    torch.empty = _poisoned_empty
    try:
        result = fn(*args)
    finally:
        torch.empty = _real_empty
    return result


def record(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'}  {name:<64} {detail}", flush=True)
    if not ok:
        failures.append(name)


def compare(name: str, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    out, ref = out.double(), ref.double()
    rel = float((out - ref).norm() / ref.norm().clamp_min(1e-30))
    finite = bool(torch.isfinite(out).all())
    tol = TOLERANCE[dtype]
    record(name, finite and rel <= tol, f"rel_err={rel:.2e} (tol {tol:.0e}){'' if finite else ' NON-FINITE'}")


def short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------- elementwise


def check_elementwise(token_counts: list[int]) -> None:
    for dtype in DTYPES:
        weight = torch.randn(VOCAB, HIDDEN, device=DEVICE).to(dtype)
        for tokens in token_counts:
            ids = torch.randint(0, VOCAB, (tokens,), device=DEVICE)
            compare(f"embedding T={tokens} {short(dtype)}", poisoned(embedding_triton, ids, weight),
                    embedding_ref(ids, weight.float()), dtype)
        del weight
        norm_weight = (1 + 0.1 * torch.randn(HIDDEN, device=DEVICE)).to(dtype)
        cache = build_cos_sin_cache(HEAD_DIM, 131072, 500000.0, LLAMA3_SCALING, DEVICE)
        for tokens in token_counts:
            x = torch.randn(tokens, HIDDEN, device=DEVICE).to(dtype)
            residual = (4 * torch.randn(tokens, HIDDEN, device=DEVICE)).to(dtype)
            compare(f"rms_norm T={tokens} {short(dtype)}", poisoned(rms_norm_triton, x, norm_weight, 1e-5),
                    rms_norm_ref(x.float(), norm_weight.float(), 1e-5), dtype)
            normed, new_residual = poisoned(fused_add_rms_norm_triton, x, residual, norm_weight, 1e-5)
            ref_normed, ref_residual = fused_add_rms_norm_ref(x.float(), residual.float(), norm_weight.float(), 1e-5)
            compare(f"fused_add_rms_norm T={tokens} {short(dtype)} (normed)", normed, ref_normed, dtype)
            compare(f"fused_add_rms_norm T={tokens} {short(dtype)} (residual)", new_residual, ref_residual, dtype)

            qkv = torch.randn(tokens, (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, device=DEVICE).to(dtype)
            q = qkv[:, : NUM_Q_HEADS * HEAD_DIM].view(tokens, NUM_Q_HEADS, HEAD_DIM)
            k = qkv[:, NUM_Q_HEADS * HEAD_DIM : (NUM_Q_HEADS + NUM_KV_HEADS) * HEAD_DIM].view(
                tokens, NUM_KV_HEADS, HEAD_DIM
            )
            positions = torch.randint(0, 131072, (tokens,), device=DEVICE)
            ref_q, ref_k = rotary_embedding_ref(positions, q.float(), k.float(), cache)
            rotary_embedding_triton(positions, q, k, cache)  # in place, on views of qkv
            compare(f"rotary_embedding T={tokens} {short(dtype)} (q)", q, ref_q, dtype)
            compare(f"rotary_embedding T={tokens} {short(dtype)} (k)", k, ref_k, dtype)

            gate_up = (2 * torch.randn(tokens, 2 * INTERMEDIATE, device=DEVICE)).to(dtype)
            compare(f"silu_and_mul T={tokens} {short(dtype)}", poisoned(silu_and_mul_triton, gate_up),
                    silu_and_mul_ref(gate_up.float()), dtype)


def random_cache_slots(tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random K and V cache with room to spare, and distinct slots for `tokens` tokens, 5% padding (-1)."""
    num_blocks = tokens // BLOCK_SIZE + 64
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=DEVICE).to(dtype)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=DEVICE)[:tokens]
    slots[torch.rand(tokens, device=DEVICE) < 0.05] = -1
    return k_cache, torch.randn_like(k_cache), slots


def check_store_kv(tokens: int) -> None:
    for dtype in DTYPES:
        k_cache, v_cache, slots = random_cache_slots(tokens, dtype)
        k = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, device=DEVICE).to(dtype)
        v = torch.randn_like(k)
        ref_k, ref_v = k_cache.clone(), v_cache.clone()
        store_kv_ref(k, v, ref_k, ref_v, slots)
        store_kv_triton(k, v, k_cache, v_cache, slots)
        exact = torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
        record(f"store_kv T={tokens} {short(dtype)}", exact, "bit-exact" if exact else "differs from store_kv_ref")


def check_rotary_and_store(token_counts: list[int]) -> None:
    cache = build_cos_sin_cache(HEAD_DIM, 131072, 500000.0, LLAMA3_SCALING, DEVICE)
    for dtype in DTYPES:
        for tokens in token_counts:
            k_cache, v_cache, slots = random_cache_slots(tokens, dtype)
            qkv = torch.randn(tokens, (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, device=DEVICE).to(dtype)
            q, k, v = qkv.split([NUM_Q_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], dim=-1)
            q, k, v = (x.view(tokens, -1, HEAD_DIM) for x in (q, k, v))
            positions = torch.randint(0, 131072, (tokens,), device=DEVICE)
            ref_k, ref_v = k_cache.float(), v_cache.float()
            ref_q = rotary_embedding_and_store_ref(positions, q.float(), k.float(), v.float(), cache, ref_k, ref_v,
                                                   slots)
            original_k, original_cache = k.clone(), k_cache.clone()
            rotary_embedding_and_store_triton(positions, q, k, v, cache, k_cache, v_cache, slots)  # q in place
            name = f"rotary_embedding_and_store T={tokens} {short(dtype)}"
            compare(f"{name} (q)", q, ref_q, dtype)
            written = torch.zeros(k_cache.shape[0] * BLOCK_SIZE, dtype=torch.bool, device=DEVICE)
            written[slots[slots >= 0]] = True
            flat_k, flat_ref_k = k_cache.flatten(0, 1), ref_k.flatten(0, 1)
            compare(f"{name} (k cache)", flat_k[written], flat_ref_k[written], dtype)
            exact = (torch.equal(flat_k[~written], original_cache.flatten(0, 1)[~written])
                     and torch.equal(v_cache, ref_v.to(dtype)) and torch.equal(k, original_k))
            record(f"{name} (v, other slots, k)", exact,
                   "bit-exact" if exact else "v, another slot or k itself changed")


# ------------------------------------------------------------------------------------------------ attention


def paged_batch(
    query_lens: list[int], context_lens: list[int], dtype: torch.dtype, num_q_heads: int = NUM_Q_HEADS,
    num_kv_heads: int = NUM_KV_HEADS, head_dim: int = HEAD_DIM, block_size: int = BLOCK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random q and paged KV; blocks are a random permutation of the pool and every slot no sequence
    owns is NaN (reading one poisons the output)."""
    blocks_per_seq = [math.ceil(c / block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 16
    order = torch.randperm(num_blocks, device=DEVICE)
    block_tables = torch.zeros(len(context_lens), max(blocks_per_seq) + 2, dtype=torch.int32, device=DEVICE)
    owned = torch.zeros(num_blocks, block_size, dtype=torch.bool, device=DEVICE)
    start = 0
    for i, context_len in enumerate(context_lens):
        blocks = order[start : start + blocks_per_seq[i]]
        start += blocks_per_seq[i]
        block_tables[i, : len(blocks)] = blocks.int()
        positions = torch.arange(context_len, device=DEVICE)
        owned[blocks[positions // block_size], positions % block_size] = True
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device=DEVICE).to(dtype)
    v_cache = torch.randn(shape, device=DEVICE).to(dtype)
    k_cache[~owned], v_cache[~owned] = float("nan"), float("nan")
    q = torch.randn(sum(query_lens), num_q_heads, head_dim, device=DEVICE).to(dtype)
    return q, k_cache, v_cache, attention_metadata(query_lens, context_lens, block_tables)


def check_attention_case(
    name: str, query_lens: list[int], context_lens: list[int], max_context_len: int | None = None, **shape
) -> None:
    for dtype in DTYPES:
        q, k_cache, v_cache, meta = paged_batch(query_lens, context_lens, dtype, **shape)
        if max_context_len is not None:  # as a CUDA graph captured for longer contexts launches
            meta.max_context_len = max_context_len
        scale = q.shape[-1] ** -0.5
        t0 = time.perf_counter()
        out = poisoned(paged_attention_triton, q, k_cache, v_cache, meta, scale)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        ref = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, scale)
        path = "decode" if meta.is_decode else "prefill"
        compare(f"attention {path} {name} {short(dtype)} ({elapsed * 1e3:.0f} ms first call)", out, ref, dtype)


def rand_lens(n: int, low: int, high: int) -> list[int]:
    return torch.randint(low, high + 1, (n,)).tolist()


def check_attention(quick: bool) -> None:
    prompt_lens = rand_lens(8, 1, 2048)
    prompt_lens[0] = 2048
    check_attention_case(f"8 prompts <=2048 ({sum(prompt_lens)} tokens)", prompt_lens, prompt_lens)
    # chunked prefill: chunks of up to 512 new tokens on top of cached prefixes up to 4096
    chunks = rand_lens(8, 1, 512)
    contexts = [c + p for c, p in zip(chunks, rand_lens(8, 0, 4096))]
    check_attention_case("8 chunks <=512 on prefixes <=4096", chunks, contexts)
    # mixed batch through the prefill path: decodes, an idle sequence, prefill chunks
    mixed_q = [1] * 16 + [0] + rand_lens(4, 2, 300)
    mixed_ctx = rand_lens(16, 1, 3000) + [50] + [q + p for q, p in zip(mixed_q[17:], rand_lens(4, 0, 1000))]
    check_attention_case("mixed 16 decodes + idle + 4 chunks", mixed_q, mixed_ctx)
    # head_dim 128 (Llama-3-8B shape) and a GQA group of 3 (SmolLM2: 9 query / 3 KV heads)
    check_attention_case("d128 4 prompts", [700, 64, 1, 300], [700, 64, 1, 1300], head_dim=128)
    check_attention_case("9q/3kv 3 chunks", [257, 31, 1], [1000, 31, 2000], num_q_heads=9, num_kv_heads=3)

    decode_contexts = rand_lens(64, 1, 8192)
    decode_contexts[0] = 8192
    check_attention_case("batch 64 contexts <=8192", [1] * 64, decode_contexts)
    check_attention_case("batch 1 context 8192", [1], [8192])
    check_attention_case("batch 1 context 37", [1], [37])
    check_attention_case("batch 4 contexts <=3000, grid for 131072", [1] * 4, rand_lens(4, 1, 3000),
                         max_context_len=131072)
    if not quick:
        check_attention_case("batch 256 contexts <=2048", [1] * 256, rand_lens(256, 1, 2048))
        check_attention_case("batch 8 contexts <=32768", [1] * 8, rand_lens(8, 16384, 32768))
    check_attention_case("d128 batch 16", [1] * 16, rand_lens(16, 1, 4096), head_dim=128)
    check_attention_case("9q/3kv batch 5", [1, 1, 0, 1, 1], [3000, 17, 40, 1, 640], num_q_heads=9, num_kv_heads=3)
    check_decode_cuda_graph()


def check_decode_cuda_graph() -> None:
    """Decode attention captured in a CUDA graph at max_context_len 4096, replayed on shorter contexts."""
    dtype = torch.bfloat16
    batch = 32
    q, k_cache, v_cache, meta = paged_batch([1] * batch, [4096] * batch, dtype)
    scale = HEAD_DIM**-0.5
    paged_attention_triton(q, k_cache, v_cache, meta, scale)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged_attention_triton(q, k_cache, v_cache, meta, scale)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention_triton(q, k_cache, v_cache, meta, scale)
    new_lens = torch.randint(1, 4097, (batch,), dtype=torch.int32, device=DEVICE)
    meta.context_lens.copy_(new_lens)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    ref = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    compare("attention decode in a CUDA graph, replayed on new contexts bf16", out, ref, dtype)


# ------------------------------------------------------------------------------------------------- sampling


def params(rows: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0):
    return (
        torch.full((rows,), temperature, device=DEVICE),
        torch.full((rows,), top_k, dtype=torch.int64, device=DEVICE),
        torch.full((rows,), top_p, device=DEVICE),
        torch.full((rows,), min_p, device=DEVICE),
    )


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.719: p = 1e-4)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def check_sampling_distribution(
    name: str, logits: torch.Tensor, draws: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
    min_p: float = 0.0,
) -> None:
    """Draws with `draws` different seeds from one row of logits; frequencies against the truncated
    tempered softmax computed by sample_ref's rules, and no masked token ever drawn."""
    vocab = logits.shape[0]
    probs = (logits / temperature).softmax(-1)
    sorted_probs, order = probs.sort(descending=True)
    rank = torch.arange(vocab, device=DEVICE)
    drop = (rank >= (top_k if top_k > 0 else vocab)) | (sorted_probs.cumsum(0) - sorted_probs >= top_p)
    drop |= sorted_probs < min_p * sorted_probs[0]
    drop[0] = False
    expected = torch.zeros(vocab, device=DEVICE).scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    expected = (expected / expected.sum()).double()
    seeds = torch.randint(0, 2**62, (draws,), device=DEVICE)
    out = sample_triton(logits.expand(draws, vocab), *params(draws, temperature, top_k, top_p, min_p), seeds)
    counts = torch.bincount(out, minlength=vocab).double()
    kept = expected > 0
    masked_draws = int(counts[~kept].sum())
    # pool the categories expected fewer than 5 times into one, as the chi-square test asks
    exp_counts, obs_counts = draws * expected[kept], counts[kept]
    small = exp_counts < 5
    if small.any():
        exp_counts = torch.cat([exp_counts[~small], exp_counts[small].sum().view(1)])
        obs_counts = torch.cat([obs_counts[~small], obs_counts[small].sum().view(1)])
    chi2 = float(((obs_counts - exp_counts) ** 2 / exp_counts).sum())
    df = max(exp_counts.numel() - 1, 1)
    ok = masked_draws == 0 and chi2 < chi2_critical(df)
    record(f"sample distribution {name}", ok,
           f"chi2={chi2:.1f} df={df} (crit {chi2_critical(df):.1f}), masked tokens drawn: {masked_draws}")


def check_sampling() -> None:
    batch = 64
    logits = 4 * torch.randn(batch, VOCAB, device=DEVICE)
    temperature, top_k, top_p, min_p = params(batch, top_p=0.9)
    temperature[: batch // 2] = 0.0
    top_k[batch // 2 :] = 1
    seeds = torch.arange(batch, device=DEVICE)
    out = poisoned(sample_triton, logits, temperature, top_k, top_p, min_p, seeds)
    same = torch.equal(out, logits.argmax(-1))
    record(f"sample greedy + top_k=1 rows == argmax B={batch} V={VOCAB}", same, "exact" if same else "differs")

    temperature, top_k, top_p, min_p = params(batch, temperature=0.8, top_k=50)
    top_p[::3], min_p[1::3], top_k[2::3] = 0.9, 0.05, 0
    together = sample_triton(logits, temperature, top_k, top_p, min_p, seeds)
    alone = torch.cat([
        sample_triton(logits[i : i + 1], temperature[i : i + 1], top_k[i : i + 1], top_p[i : i + 1],
                      min_p[i : i + 1], seeds[i : i + 1])
        for i in range(0, batch, 7)
    ])
    same = torch.equal(alone, together[::7])
    record("sample: a row's token is the same alone and in a batch", same, "exact" if same else "differs")

    small = torch.tensor([0.3, -1.2, 1.1, 2.0, 2.4, -0.2, 0.9, 0.0], device=DEVICE)
    check_sampling_distribution("V=8 T=0.7 top_p=0.8", small, 100_000, temperature=0.7, top_p=0.8)
    check_sampling_distribution("V=8 T=1.3 top_k=5 min_p=0.05", small, 100_000, temperature=1.3, top_k=5, min_p=0.05)
    wide = 2 * torch.randn(VOCAB, device=DEVICE)
    wide[:30] += 8  # a head of ~30 likely tokens above a long tail
    check_sampling_distribution(f"V={VOCAB} T=1 top_k=20", wide, 8192, top_k=20)
    check_sampling_distribution(f"V={VOCAB} T=0.9 top_p=0.6", wide, 4096, temperature=0.9, top_p=0.6)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer token counts and batch shapes")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("check_kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    t0 = time.perf_counter()
    check_elementwise([1, 8192] if args.quick else [1, 7, 1000, 8192])
    check_store_kv(8192)
    check_rotary_and_store([1, 8192] if args.quick else [1, 7, 1000, 8192])
    check_attention(args.quick)
    check_sampling()
    print(f"\n{len(failures)} failure(s) in {time.perf_counter() - t0:.0f} s")
    for name in failures:
        print(f"  FAIL {name}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
