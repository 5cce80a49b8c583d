"""Token sampling from final logits: greedy, temperature, top-k, top-p, min-p, per-row seeds."""

import functools

import torch

from tinyvllm.ops.pdl import pdl_options, pdl_wait, runs_ptx
from tinyvllm.ops.triton_import import tl, triton


def sample_ref(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               min_p: torch.Tensor, seeds: torch.Tensor, use_top_p: bool | None = None, max_top_k: int | None = None,
               use_min_p: bool | None = None) -> torch.Tensor:
    """logits [B, V] (any float dtype, read as float32) and per-row parameters [B] -> token ids [B] int64.

    A row with temperature 0 is greedy. Otherwise probs = softmax(logits / T), truncated to the top_k
    most likely tokens (top_k <= 0: all), to the smallest set whose mass reaches top_p, and to tokens
    with p >= min_p * p_max; then one token is drawn as argmax(p / E), E ~ Exp(1) (the exponential race
    is an exact draw from p). E comes from a generator seeded with seeds[row], so a row's draw depends
    on its own seed only, whatever else is in the batch. use_top_p / max_top_k / use_min_p are hints for the
    kernel (whether any sampled row has top_p < 1, its largest active top_k, whether any has min_p > 0),
    unused here."""
    logits = logits.float()
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
        USE_TOP_P: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        pdl_wait(USE_PDL)
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

    @triton.jit
    def _keep_max(x, cols, best, best_col):
        """Lane by lane, the running max of blocks [ROWS, BLOCK] and the token id where it was first met (strict
        >): no reduction per block, one per chunk (_first_max)."""
        better = x > best
        return tl.where(better, x, best), tl.where(better, cols, best_col)

    @triton.jit
    def _first_max(best, best_col):
        """Per row, the max of the lanes' maxima and the lowest token id holding it: the first index of the max,
        as one sequential scan with strict > finds it (each lane kept its first; a row of -inf: the first lane's
        first token)."""
        top = tl.max(best, axis=1)
        return top, tl.min(tl.where(best == top[:, None], best_col, 2147483647), axis=1)

    @triton.jit
    def _log2(x, FAST: tl.constexpr):
        """log2(x); FAST (on the GPU): the SFU's lg2.approx, one instruction against libdevice's precise logf (about
        fifteen and a branch), which took most of a large batch's sampling time. Its error is under 2^-22, absolute
        for x in (1/2, 2) and relative elsewhere: harmless in a score (log2 E), but large against log2(x) itself
        for x near 1, which is why _exponential takes its series there."""
        if FAST:
            return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                             is_pure=True, pack=1)
        else:
            return tl.log2(x)

    @triton.jit
    def _exponential(r, FAST: tl.constexpr):
        """E = -ln(U) ~ Exp(1) for U = (r + 1/2) / 2^32, r uniform 32-bit integers, to a relative error under 1e-6
        everywhere (tests/test_ops_triton.py). Both U and d = 1 - U come from the integer, so each keeps 24
        significant bits: U near 1 (E small: the race's winners), where log(U) loses its digits, takes the series
        E = -ln(1 - d) = d + d^2/2 + ... + d^7/7 (d < 1/8: the terms left out are under 1e-7 of E); the rest
        E = -ln(2) log2(U)."""
        d = ((~r).to(tl.float32) + 0.5) * 2.3283064365386963e-10  # (2^32 - 1 - r + 1/2) / 2^32
        series = d * (1.0 + d * (0.5 + d * (1.0 / 3 + d * (0.25 + d * (0.2 + d * (1.0 / 6 + d * (1.0 / 7)))))))
        u = (r.to(tl.float32) + 0.5) * 2.3283064365386963e-10  # (at most 1: where it rounds to 1, the series is taken)
        return tl.where(d < 0.125, series, -0.6931471805599453 * _log2(u, FAST))

    @triton.jit
    def _race_scores(x, start, keep, seeds, scale, BLOCK: tl.constexpr, FAST_LOG: tl.constexpr):
        """s_i = x_i * scale - log2(E_i) with scale = log2(e) / T: log2(p_i / E_i) up to a constant of the row, for
        the kept tokens of x (the tokens [start, start + BLOCK) of each row), -inf elsewhere. E_i ~ Exp(1) from
        Philox keyed by the row's own seed, four numbers per call: token i takes number i % 4 of the call with
        counter i // 4 (start is a multiple of 4), so a row's numbers depend on its seed and the token ids only,
        whatever the chunking, the block or ROWS. One call per token, as tl.rand makes, would spend most of a
        large batch's sampling time in Philox."""
        quads = start // 4 + tl.arange(0, BLOCK // 4)[None, :]
        r0, r1, r2, r3 = tl.randint4x(seeds[:, None], quads)
        r = tl.interleave(tl.interleave(r0, r2), tl.interleave(r1, r3))  # r0[0], r1[0], r2[0], r3[0], r0[1], ...
        return tl.where(keep, x * scale[:, None] - _log2(_exponential(r, FAST_LOG), FAST_LOG), float("-inf"))

    @triton.jit
    def _program_chunk(num_rows, vocab, chunk_16s, ROWS: tl.constexpr):
        """This program's ROWS rows (and which are real), its chunk of the vocabulary, [start, end), and the chunk's
        size. The size comes in 16s (chunk_16s): start and size are then multiples of 16 that Triton can see (a
        hint on a number that varies per launch does not reach the loop), so the loads of the logits are
        16-byte vectors."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        chunk, num_chunks = tl.program_id(1), tl.num_programs(1)
        chunk_size = chunk_16s * 16
        chunk_start = chunk * chunk_size
        chunk_end = tl.minimum(chunk_start + chunk_size, vocab)
        return rows, rows < num_rows, chunk, num_chunks, chunk_start, chunk_end, chunk_size

    @triton.jit
    def _in_chunk(cols, chunk_start, chunk_size, vocab):
        """cols < min(chunk end, vocab), as two tests, so that the divisibility of each bound (16, and vocab's when it
        is a multiple of 16) shows and the masked loads stay 16-byte vectors."""
        return (cols < chunk_start + chunk_size) & (cols < vocab)

    # Grid (row groups, chunks): ROWS rows (1 unless the whole vocabulary is one chunk) x the tokens
    # [chunk * chunk_size, (chunk + 1) * chunk_size) of each, in one pass:
    #   x_max and its first index over the chunk (a greedy row's answer is the first of the row's max);
    #   for a sampled row (unless DEFER_MIN_P and min_p > 0: _min_p_race_kernel races it), keep x_i >= cutoff
    #   and the best race score s_i = log2(p_i / E_i) + c (_race_scores) with its first index. argmax_i s_i over
    #   the row is the exponential race argmax p_i / E_i, an exact draw from the kept tempered softmax.
    # Partials: value[0 or 1, row, chunk] = (chunk max, best race score), index[...] their token ids.
    @triton.jit(do_not_specialize=["num_rows", "chunk_16s"])
    def _sample_chunk_kernel(
        value_ptr, index_ptr, logits_ptr, cutoff_ptr, temperature_ptr, min_p_ptr, seeds_ptr,
        num_rows, vocab, stride_logits, chunk_16s,
        HAS_CUTOFF: tl.constexpr, DEFER_MIN_P: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
        FAST_LOG: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        pdl_wait(USE_PDL)
        rows, row_mask, chunk, num_chunks, chunk_start, chunk_end, chunk_size = _program_chunk(num_rows, vocab,
                                                                                              chunk_16s, ROWS)
        base = logits_ptr + rows.to(tl.int64)[:, None] * stride_logits
        temperature = tl.load(temperature_ptr + rows, mask=row_mask, other=0.0)
        race = temperature != 0
        if DEFER_MIN_P:
            race = race & ~(tl.load(min_p_ptr + rows, mask=row_mask, other=0.0) > 0)
        lanes = chunk_start + tl.arange(0, BLOCK)[None, :] + tl.zeros([ROWS, BLOCK], dtype=tl.int32)
        best = tl.full([ROWS, BLOCK], float("-inf"), dtype=tl.float32)
        race_best, best_col, race_col = best, lanes, lanes
        race_any = tl.sum(race.to(tl.int32), axis=0) > 0
        if race_any:
            temperature = tl.where(temperature > 0, temperature, 1.0)  # as sample_ref: T < 0 samples at T = 1
            scale = 1.4426950408889634 / temperature  # log2(e) / T
            threshold = tl.full([ROWS], float("-inf"), dtype=tl.float32)
            if HAS_CUTOFF:  # a logit of the row, so never above its max: the most likely token survives
                threshold = tl.load(cutoff_ptr + rows, mask=row_mask, other=0.0)
            seeds = tl.load(seeds_ptr + rows, mask=row_mask, other=0)
            for start in range(chunk_start, chunk_end, BLOCK):
                cols = start + tl.arange(0, BLOCK)[None, :]
                in_chunk = _in_chunk(cols, chunk_start, chunk_size, vocab)
                x = tl.load(base + cols, mask=row_mask[:, None] & in_chunk, other=float("-inf")).to(tl.float32)
                best, best_col = _keep_max(x, cols, best, best_col)
                score = _race_scores(x, start, in_chunk & (x >= threshold[:, None]), seeds, scale, BLOCK, FAST_LOG)
                race_best, race_col = _keep_max(score, cols, race_best, race_col)
        else:  # greedy rows only (or all deferred to the min-p pass): the max alone
            for start in range(chunk_start, chunk_end, BLOCK):
                cols = start + tl.arange(0, BLOCK)[None, :]
                x = tl.load(base + cols, mask=row_mask[:, None] & _in_chunk(cols, chunk_start, chunk_size, vocab),
                            other=float("-inf"))
                best, best_col = _keep_max(x.to(tl.float32), cols, best, best_col)
        best, best_index = _first_max(best, best_col)
        race_best, race_index = _first_max(race_best, race_col)
        race_best = tl.where(race, race_best, float("-inf"))
        part = rows * num_chunks + chunk
        races = num_rows * num_chunks
        tl.store(value_ptr + part, best, mask=row_mask)
        tl.store(index_ptr + part, best_index, mask=row_mask)
        tl.store(value_ptr + races + part, race_best, mask=row_mask)
        tl.store(index_ptr + races + part, race_index, mask=row_mask)

    # The min-p pass, for the sampled rows with min_p > 0 that _sample_chunk_kernel left out: keep
    # x_i >= max(cutoff, x_max + T*log(min_p)) (p_i >= min_p * p_max; capped at x_max so the most likely token
    # survives), x_max the largest of the chunk maxima stored by the chunk kernel; then the same race over the
    # chunk, its winner stored in place of the chunk kernel's. Other rows return at once.
    @triton.jit(do_not_specialize=["num_rows", "chunk_16s"])
    def _min_p_race_kernel(
        value_ptr, index_ptr, logits_ptr, cutoff_ptr, temperature_ptr, min_p_ptr, seeds_ptr,
        num_rows, vocab, stride_logits, chunk_16s,
        HAS_CUTOFF: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr,
        FAST_LOG: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        pdl_wait(USE_PDL)
        rows, row_mask, chunk, num_chunks, chunk_start, chunk_end, chunk_size = _program_chunk(num_rows, vocab,
                                                                                              chunk_16s, ROWS)
        temperature = tl.load(temperature_ptr + rows, mask=row_mask, other=0.0)
        min_p = tl.load(min_p_ptr + rows, mask=row_mask, other=0.0)
        race = row_mask & (temperature != 0) & (min_p > 0)
        if tl.sum(race.to(tl.int32), axis=0) > 0:
            base = logits_ptr + rows.to(tl.int64)[:, None] * stride_logits
            chunks = tl.arange(0, CHUNKS)[None, :]
            maxima = tl.load(value_ptr + rows[:, None] * num_chunks + chunks,
                             mask=row_mask[:, None] & (chunks < num_chunks), other=float("-inf"))
            best = tl.max(maxima, axis=1)
            temperature = tl.where(temperature > 0, temperature, 1.0)
            scale = 1.4426950408889634 / temperature  # log2(e) / T
            threshold = best + temperature * tl.log(min_p)
            if HAS_CUTOFF:
                threshold = tl.maximum(threshold, tl.load(cutoff_ptr + rows, mask=row_mask, other=0.0))
            threshold = tl.minimum(threshold, best)
            seeds = tl.load(seeds_ptr + rows, mask=row_mask, other=0)
            race_best = tl.full([ROWS, BLOCK], float("-inf"), dtype=tl.float32)
            race_col = chunk_start + tl.arange(0, BLOCK)[None, :] + tl.zeros([ROWS, BLOCK], dtype=tl.int32)
            for start in range(chunk_start, chunk_end, BLOCK):
                cols = start + tl.arange(0, BLOCK)[None, :]
                in_chunk = _in_chunk(cols, chunk_start, chunk_size, vocab)
                x = tl.load(base + cols, mask=row_mask[:, None] & in_chunk, other=float("-inf")).to(tl.float32)
                score = _race_scores(x, start, in_chunk & (x >= threshold[:, None]), seeds, scale, BLOCK, FAST_LOG)
                race_best, race_col = _keep_max(score, cols, race_best, race_col)
            race_best, race_index = _first_max(race_best, race_col)
            part = num_rows * num_chunks + rows * num_chunks + chunk
            tl.store(value_ptr + part, race_best, mask=race)
            tl.store(index_ptr + part, race_index, mask=race)

    # ROWS rows per program, each from its chunks' partials: the chunks in token order and ties to the lowest
    # chunk, so that ties go to the lowest token index as in one sequential scan with strict >. A greedy row
    # takes the first index of the largest chunk max (torch.argmax's answer), a sampled row the race winner
    # (the greedy answer where no token got a finite score, as the sequential kernel did).
    @triton.jit(do_not_specialize=["num_rows", "num_chunks"])
    def _sample_reduce_kernel(
        out_ptr, value_ptr, index_ptr, temperature_ptr, num_rows, num_chunks,
        ROWS: tl.constexpr, CHUNKS: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        pdl_wait(USE_PDL)
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        row_mask = rows < num_rows
        chunks = tl.arange(0, CHUNKS)[None, :]
        part = rows[:, None] * num_chunks + chunks
        mask = row_mask[:, None] & (chunks < num_chunks)
        races = num_rows * num_chunks
        maxima = tl.load(value_ptr + part, mask=mask, other=float("-inf"))
        _, best_chunk = tl.max(maxima, axis=1, return_indices=True)
        greedy = tl.load(index_ptr + rows * num_chunks + best_chunk, mask=row_mask, other=0)
        scores = tl.load(value_ptr + races + part, mask=mask, other=float("-inf"))
        race_best, race_chunk = tl.max(scores, axis=1, return_indices=True)
        sampled = tl.load(index_ptr + races + rows * num_chunks + race_chunk, mask=row_mask, other=0)
        temperature = tl.load(temperature_ptr + rows, mask=row_mask, other=0.0)
        token = tl.where((temperature != 0) & (race_best > float("-inf")), sampled, greedy)
        tl.store(out_ptr + rows, token.to(tl.int64), mask=row_mask)


# Tokens per program of the chunk kernels: at least MIN (a batch of 1 spreads 128k tokens over ~63 SMs), at most
# MAX (a large batch keeps few partials per row), else about PROGRAMS_PER_SM programs per SM.
_MIN_CHUNK, _MAX_CHUNK, _PROGRAMS_PER_SM = 2048, 16384, 4
_MAX_BLOCK = 1024  # tokens per loop step: 8 per thread at 4 warps (the fastest from 16 rows to 256 on the H200)
_CPU_SMS = 132  # under the interpreter: an H100/H200's count, so that tests pick the chunks a GPU would


def sample_triton(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor, seeds: torch.Tensor, use_top_p: bool | None = None,
                  max_top_k: int | None = None, use_min_p: bool | None = None, *, chunk_size: int | None = None,
                  block: int | None = None) -> torch.Tensor:
    """The Triton kernels of sample_ref (same truncation, its own counter-based RNG: Philox keyed by the
    row's seed and the token id, so a row's draw depends on its logits, parameters and seed only, not on
    the batch nor on how the vocabulary is split between programs). torch.sort (top-p) or torch.topk
    (top-k only) orders the logits. Which is needed comes from the hints use_top_p and max_top_k when the
    caller gives them (the engine knows them from the requests); otherwise one host sync reads them, and
    use_min_p with them. Given those two, use_min_p=None costs no sync: the min-p pass runs, and returns at
    once where no row has min_p > 0. chunk_size (tokens per program) and block (tokens per loop step, a
    power of two) override the heuristics, for tests and benchmarks."""
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
        flags = torch.stack([(sampled & (top_p < 1)).any().long(), torch.where(k_active, top_k, 0).max().long(),
                             (sampled & (min_p > 0)).any().long()])
        found_top_p, found_top_k, found_min_p = (int(f) for f in flags.tolist())
        use_top_p = bool(found_top_p) if use_top_p is None else use_top_p
        max_top_k = found_top_k if max_top_k is None else max_top_k
        use_min_p = bool(found_min_p) if use_min_p is None else use_min_p
    cutoff = temperature  # unused unless has_cutoff
    has_cutoff = bool(use_top_p) or max_top_k > 0
    if has_cutoff:
        if use_top_p:
            ordered, width = logits.sort(dim=-1, descending=True).values, vocab
        else:
            ordered, width = logits.topk(max_top_k, dim=-1).values, max_top_k
        cutoff = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
        # top-k alone reads one logit per row: a fixed tile, so that no top_k value compiles a new kernel
        cutoff_block, rows = _tile(num_rows, width) if use_top_p else (16, 128)
        _top_k_top_p_cutoff_kernel[(triton.cdiv(num_rows, rows),)](
            cutoff, ordered, temperature, top_k, top_p, num_rows, width, vocab, ordered.stride(0),
            USE_TOP_P=bool(use_top_p), ROWS=rows, BLOCK=cutoff_block, num_warps=8, **pdl_options(logits),
        )

    # chunks and blocks start at multiples of 16: of 4, the tokens of one Philox call (_race_scores), and of 8 so that
    # the chunk kernels read the logits in 16-byte vectors (where the vocabulary is a multiple of 8 too)
    chunk_size = triton.cdiv(chunk_size or _chunk_size(num_rows, vocab, logits.device), 16) * 16
    num_chunks = triton.cdiv(vocab, chunk_size)
    block = max(min(block or _MAX_BLOCK, triton.next_power_of_2(chunk_size)), 16)
    # one chunk per row (small vocabularies): several rows per program, as in _tile
    rows = min(triton.next_power_of_2(num_rows), max(1, _MAX_BLOCK // block)) if num_chunks == 1 else 1
    num_warps = max(1, min(8, block // 256))
    values = torch.empty((2, num_rows, num_chunks), dtype=torch.float32, device=logits.device)
    indices = torch.empty((2, num_rows, num_chunks), dtype=torch.int32, device=logits.device)
    grid = (triton.cdiv(num_rows, rows), num_chunks)
    args = (values, indices, logits, cutoff, temperature, min_p, seeds, num_rows, vocab, logits.stride(0),
            chunk_size // 16)
    defer_min_p = use_min_p is not False
    fast_log = runs_ptx(logits)
    _sample_chunk_kernel[grid](
        *args, HAS_CUTOFF=has_cutoff, DEFER_MIN_P=defer_min_p, ROWS=rows, BLOCK=block, FAST_LOG=fast_log,
        num_warps=num_warps, **pdl_options(logits),
    )
    # CHUNKS (a constexpr) sized for the most chunks any batch size gets, not this one's: otherwise each batch
    # size band would compile its own variant of the two kernels below, in the middle of a run.
    chunks_pow2 = triton.next_power_of_2(max(num_chunks, triton.cdiv(vocab, _MIN_CHUNK)))
    if defer_min_p:
        _min_p_race_kernel[grid](
            *args, HAS_CUTOFF=has_cutoff, ROWS=rows, BLOCK=block, CHUNKS=chunks_pow2, FAST_LOG=fast_log,
            num_warps=num_warps, **pdl_options(logits),
        )
    reduce_rows = max(1, 1024 // chunks_pow2)
    _sample_reduce_kernel[(triton.cdiv(num_rows, reduce_rows),)](
        out, values, indices, temperature, num_rows, num_chunks, ROWS=reduce_rows, CHUNKS=chunks_pow2, num_warps=4,
        **pdl_options(logits),
    )
    return out


def _chunk_size(num_rows: int, vocab: int, device: torch.device) -> int:
    """Tokens per program: about _PROGRAMS_PER_SM programs per SM over the batch, a power of two within
    [_MIN_CHUNK, _MAX_CHUNK]."""
    target = triton.cdiv(num_rows * vocab, _PROGRAMS_PER_SM * _num_sms(device))
    return min(max(triton.next_power_of_2(target), _MIN_CHUNK), _MAX_CHUNK)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _CPU_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _tile(num_rows: int, width: int) -> tuple[int, int]:
    """(BLOCK, ROWS): up to 4096 columns per step; small vocabularies pack several rows per program."""
    block = min(triton.next_power_of_2(width), 4096)
    return block, min(triton.next_power_of_2(num_rows), 4096 // block)
