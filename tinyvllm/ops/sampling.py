"""Token sampling from final logits: greedy, temperature, top-k, top-p, min-p, per-row seeds."""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU engine imports the reference on machines without Triton
    triton = None


def sample_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    use_top_p: bool | None = None,
    max_top_k: int | None = None,
) -> torch.Tensor:
    """logits [B, V] float32 and per-row parameters [B] -> token ids [B] int64.

    A row with temperature 0 is greedy. Otherwise probs = softmax(logits / T), truncated to the top_k
    most likely tokens (top_k <= 0: all), to the smallest set whose mass reaches top_p, and to tokens
    with p >= min_p * p_max; then one token is drawn as argmax(p / E), E ~ Exp(1) (the exponential race
    is an exact draw from p). E comes from a generator seeded with seeds[row], so a row's draw depends
    on its own seed only, whatever else is in the batch. use_top_p / max_top_k are hints for the kernel
    (whether any sampled row has top_p < 1, and its largest active top_k), unused here."""
    greedy = logits.argmax(dim=-1)
    if bool((temperature == 0).all()):
        return greedy
    vocab = logits.shape[-1]
    scaled = logits / torch.where(temperature > 0, temperature, 1.0).unsqueeze(1)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    rank = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    drop = rank[None, :] >= k[:, None]
    # Keep a token if the mass before it is below top_p: the smallest prefix reaching top_p survives.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= mass_before >= top_p[:, None]
    drop |= sorted_probs < (min_p[:, None] * sorted_probs[:, :1])
    drop[:, 0] = False
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    noise = torch.empty_like(sorted_probs)
    for row, seed in enumerate(seeds.tolist()):
        generator = torch.Generator(device=logits.device).manual_seed(seed)
        noise[row].exponential_(generator=generator)
    choice = (sorted_probs / noise).argmax(dim=-1, keepdim=True)
    sampled = order.gather(1, choice).squeeze(1)
    return torch.where(temperature == 0, greedy, sampled)


if triton is not None:

    # ROWS rows per program (1 at real vocabulary sizes), each sorted in descending order x_0 >= x_1 >= ...
    # (its first `width` logits):
    #   p_j = exp((x_j - x_0) / T) / Z, Z summed over the whole row (only with USE_TOP_P)
    #   keep j while j < top_k and sum_{i<j} p_i < top_p (j = 0 always kept)
    #   cutoff = x_{kept-1}: exactly the tokens with logit >= cutoff survive top-k and top-p.
    @triton.jit(do_not_specialize=["num_rows", "width", "stride_sorted"])  # vary per step: compile once
    def _top_k_top_p_cutoff_kernel(
        cutoff_ptr, sorted_ptr, temperature_ptr, top_k_ptr, top_p_ptr, num_rows, width, vocab, stride_sorted,
        USE_TOP_P: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
    ):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        row_mask = rows < num_rows
        base = sorted_ptr + rows.to(tl.int64)[:, None] * stride_sorted
        temperature = tl.load(temperature_ptr + rows, mask=row_mask, other=1.0)
        scale = 1.4426950408889634 / tl.where(temperature > 0, temperature, 1.0)  # log2(e) / T
        top_k = tl.load(top_k_ptr + rows, mask=row_mask, other=0).to(tl.int32)
        top_k_off = (top_k <= 0) | (top_k >= vocab)
        top_k = tl.where(top_k_off, vocab, top_k)
        x_max = tl.load(base, mask=row_mask[:, None], other=0.0).to(tl.float32)
        if USE_TOP_P:
            top_p = tl.load(top_p_ptr + rows, mask=row_mask, other=1.0)
            z = tl.zeros([ROWS], dtype=tl.float32)
            for start in range(0, width, BLOCK):
                cols = start + tl.arange(0, BLOCK)[None, :]
                x = tl.load(base + cols, mask=row_mask[:, None] & (cols < width), other=float("-inf"))
                z += tl.sum(tl.exp2((x.to(tl.float32) - x_max) * scale[:, None]), axis=1)
            z = tl.where(row_mask, z, 1.0)
            kept = tl.zeros([ROWS], dtype=tl.int32)
            mass = tl.zeros([ROWS], dtype=tl.float32)
            for start in range(0, width, BLOCK):
                cols = start + tl.arange(0, BLOCK)[None, :]
                x = tl.load(base + cols, mask=row_mask[:, None] & (cols < width), other=float("-inf"))
                p = tl.exp2((x.to(tl.float32) - x_max) * scale[:, None]) / z[:, None]
                mass_before = mass[:, None] + tl.cumsum(p, axis=1) - p
                keep = (cols < width) & (cols < top_k[:, None]) & (mass_before < top_p[:, None])
                kept += tl.sum(keep.to(tl.int32), axis=1)
                mass += tl.sum(p, axis=1)
            kept = tl.maximum(kept, 1)
            cutoff = tl.load(sorted_ptr + rows.to(tl.int64) * stride_sorted + kept - 1, mask=row_mask)
        else:
            last = tl.minimum(top_k, width) - 1
            cutoff = tl.load(sorted_ptr + rows.to(tl.int64) * stride_sorted + last, mask=row_mask)
            cutoff = tl.where(top_k_off, float("-inf"), cutoff.to(tl.float32))
        tl.store(cutoff_ptr + rows, cutoff.to(tl.float32), mask=row_mask)

    # ROWS rows per program (1 at real vocabulary sizes), two passes over the vocabulary:
    #   pass 1: x_max and its first index (the answer of a greedy row, temperature 0)
    #   pass 2: keep x_i >= cutoff and x_i >= x_max + T*log(min_p) (p_i >= min_p * p_max); then
    #           token = argmax_i x_i/T - log(E_i) over kept i, E_i = -log(U_i), U_i = rand(seed, i):
    #           the exponential race argmax p_i / E_i, an exact draw from the kept tempered softmax.
    @triton.jit(do_not_specialize=["num_rows"])
    def _sample_kernel(
        out_ptr, logits_ptr, cutoff_ptr, temperature_ptr, min_p_ptr, seeds_ptr,
        num_rows, vocab, stride_logits, HAS_CUTOFF: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
    ):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        row_mask = rows < num_rows
        base = logits_ptr + rows.to(tl.int64)[:, None] * stride_logits
        best = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        best_index = tl.zeros([ROWS], dtype=tl.int32)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)[None, :]
            x = tl.load(base + cols, mask=row_mask[:, None] & (cols < vocab), other=float("-inf"))
            x = x.to(tl.float32)
            block_best = tl.max(x, axis=1)
            block_index = start + tl.argmax(x, axis=1)
            best_index = tl.where(block_best > best, block_index, best_index)
            best = tl.maximum(best, block_best)
        temperature = tl.load(temperature_ptr + rows, mask=row_mask, other=0.0)
        sampled = temperature != 0
        if tl.sum(sampled.to(tl.int32), axis=0) > 0:
            temperature = tl.where(temperature > 0, temperature, 1.0)  # as sample_ref: T < 0 samples at T = 1
            threshold = best + temperature * tl.log(tl.load(min_p_ptr + rows, mask=row_mask, other=0.0))
            if HAS_CUTOFF:
                threshold = tl.maximum(threshold, tl.load(cutoff_ptr + rows, mask=row_mask, other=0.0))
            threshold = tl.minimum(threshold, best)  # the most likely token always survives
            seeds = tl.load(seeds_ptr + rows, mask=row_mask, other=0)
            race_best = tl.full([ROWS], float("-inf"), dtype=tl.float32)
            race_index = best_index
            for start in range(0, vocab, BLOCK):
                cols = start + tl.arange(0, BLOCK)[None, :]
                x = tl.load(base + cols, mask=row_mask[:, None] & (cols < vocab), other=float("-inf"))
                # tl.rand keyed by each row's own seed (Philox: elementwise, so the same numbers for a row
                # whatever ROWS is), counter = token id.
                noise = tl.log(-tl.log(tl.rand(seeds[:, None], cols)))
                keep = (cols < vocab) & (x >= threshold[:, None])
                score = tl.where(keep, x.to(tl.float32) / temperature[:, None] - noise, float("-inf"))
                block_best = tl.max(score, axis=1)
                block_index = start + tl.argmax(score, axis=1)
                race_index = tl.where(block_best > race_best, block_index, race_index)
                race_best = tl.maximum(race_best, block_best)
            best_index = tl.where(sampled, race_index, best_index)
        tl.store(out_ptr + rows, best_index.to(tl.int64), mask=row_mask)


def sample_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    use_top_p: bool | None = None,
    max_top_k: int | None = None,
) -> torch.Tensor:
    """The Triton kernels of sample_ref (same truncation, its own counter-based RNG: Philox keyed by the
    row's seed and the token id, so a row's draw depends on its logits, parameters and seed only).
    torch.sort (top-p) or torch.topk (top-k only) orders the logits. Which is needed comes from the hints
    use_top_p and max_top_k when the caller gives them (the engine knows them from the requests); otherwise
    one host sync reads it from the tensors."""
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    num_rows, vocab = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    temperature, top_p, min_p = (t.to(torch.float32).contiguous() for t in (temperature, top_p, min_p))
    top_k, seeds = top_k.contiguous(), seeds.to(torch.int64).contiguous()
    if use_top_p is None or max_top_k is None:
        sampled = temperature != 0
        k_active = sampled & (top_k > 0) & (top_k < vocab)
        flags = torch.stack([(sampled & (top_p < 1)).any().long(), torch.where(k_active, top_k, 0).max().long()])
        use_top_p, max_top_k = (int(f) for f in flags.tolist())
    cutoff = temperature  # unused unless HAS_CUTOFF
    if use_top_p or max_top_k > 0:
        if use_top_p:
            ordered, width = logits.sort(dim=-1, descending=True).values, vocab
        else:
            ordered, width = logits.topk(max_top_k, dim=-1).values, max_top_k
        cutoff = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
        # top-k alone reads one logit per row: a fixed tile, so that no top_k value compiles a new kernel
        block, rows = _tile(num_rows, width) if use_top_p else (16, 128)
        _top_k_top_p_cutoff_kernel[(triton.cdiv(num_rows, rows),)](
            cutoff, ordered, temperature, top_k, top_p, num_rows, width, vocab, ordered.stride(0),
            USE_TOP_P=bool(use_top_p), ROWS=rows, BLOCK=block, num_warps=8,
        )
    block, rows = _tile(num_rows, vocab)
    _sample_kernel[(triton.cdiv(num_rows, rows),)](
        out, logits, cutoff, temperature, min_p, seeds, num_rows, vocab, logits.stride(0),
        HAS_CUTOFF=use_top_p or max_top_k > 0, ROWS=rows, BLOCK=block, num_warps=8,
    )
    return out


def _tile(num_rows: int, width: int) -> tuple[int, int]:
    """(BLOCK, ROWS): up to 4096 columns per step; small vocabularies pack several rows per program."""
    block = min(triton.next_power_of_2(width), 4096)
    return block, min(triton.next_power_of_2(num_rows), 4096 // block)
