"""Cascade attention (tinyvllm/ops/cascade_attention.py) under the Triton interpreter on CPU tensors, float32, tiny
shapes: each pass against its reference, the whole against the plain paged kernel and paged_attention_ref; the
common prefix that ModelRunner.prepare finds; and greedy outputs of the CPU engine with cascade on and off.
Outputs the kernels allocate are poisoned with NaN, and every slot of the cache no sequence owns is NaN."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from tests.utils import assert_bf16_attention_close, head_major, save_tiny_llama, tiny_llm  # noqa: E402
from tinyvllm import SamplingParams  # noqa: E402
from tinyvllm.contract import NewSequence, SchedulerOutput  # noqa: E402
from tinyvllm.ops import AttentionMetadata, cascade_attention  # noqa: E402
from tinyvllm.ops.attention import launch_combine, paged_attention_ref, paged_decode_triton  # noqa: E402
from tinyvllm.ops.cascade_attention import (  # noqa: E402
    CASCADE_MIN_PREFIX_TOKENS,
    CASCADE_MIN_SEQS,
    cascade_attention_ref,
    cascade_attention_triton,
    cascade_partials_triton,
    cascade_plan,
    cascade_prefix_ref,
    cascade_suffix_ref,
    common_prefix_len,
    use_cascade_attention,
    window_allows_cascade,
)

pytestmark = pytest.mark.usefixtures("poison_outputs")

BLOCK_SIZE = 16


def shared_prefix_batch(
    prefix_len: int, suffix_lens: list[int], num_q_heads: int, num_kv_heads: int, head_dim: int = 32,
    idle: tuple[int, ...] = (), padding: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A decode step whose sequences all start with the same prefix_len // BLOCK_SIZE blocks, then own blocks
    for their suffix_lens tokens (the newest included); sequences at `idle` have no token this step, and
    `padding` rows of context 0 follow (a CUDA graph's). Blocks are a random permutation of the pool, and
    slots no sequence owns are NaN."""
    assert prefix_len % BLOCK_SIZE == 0
    prefix_blocks = prefix_len // BLOCK_SIZE
    own_blocks = [-(-s // BLOCK_SIZE) for s in suffix_lens]
    num_blocks = prefix_blocks + sum(own_blocks) + 2
    order = torch.randperm(num_blocks).tolist()
    prefix, order = order[:prefix_blocks], order[prefix_blocks:]
    num_seqs = len(suffix_lens) + padding
    block_tables = torch.zeros(num_seqs, prefix_blocks + max(own_blocks) + 1, dtype=torch.int32)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    k_cache[prefix], v_cache[prefix] = torch.randn(prefix_blocks, *shape[1:]), torch.randn(prefix_blocks, *shape[1:])
    for i, suffix_len in enumerate(suffix_lens):
        own, order = order[: own_blocks[i]], order[own_blocks[i]:]
        block_tables[i, : prefix_blocks + len(own)] = torch.tensor(prefix + own, dtype=torch.int32)
        for j in range(suffix_len):
            k_cache[own[j // BLOCK_SIZE], j % BLOCK_SIZE] = torch.randn(num_kv_heads, head_dim)
            v_cache[own[j // BLOCK_SIZE], j % BLOCK_SIZE] = torch.randn(num_kv_heads, head_dim)
    query_lens = [0 if i in idle else 1 for i in range(len(suffix_lens))] + [1] * padding
    context_lens = [prefix_len + s for s in suffix_lens] + [0] * padding
    meta = AttentionMetadata.for_cached(query_lens, context_lens, block_tables)
    meta.max_query_len = 1
    meta.common_prefix_len = torch.tensor([prefix_len], dtype=torch.int32)
    # q as the model passes it: a view of the fused qkv projection, token rows not contiguous
    q = torch.randn(sum(query_lens), num_q_heads + 2 * num_kv_heads, head_dim)[:, :num_q_heads]
    return q, k_cache, v_cache, meta


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-5)


def _plain(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(meta.cu_query_lens, meta.context_lens, meta.block_tables, meta.slot_mapping,
                             meta.max_query_len, meta.max_context_len)


def test_cascade_ref_equals_paged_ref() -> None:
    for prefix_len, suffixes in ((0, [1, 20]), (16, [1, 5, 33]), (64, [17, 1, 40, 2])):
        q, k_cache, v_cache, meta = shared_prefix_batch(prefix_len, suffixes, 6, 2, idle=(1,), padding=1)
        _close(cascade_attention_ref(q, k_cache, v_cache, meta, 0.2),
               paged_attention_ref(q, k_cache, v_cache, _plain(meta), 0.2))


# (prefix tokens, suffix lengths (the newest token included), query heads, KV heads, prefix / suffix splits,
# decode tile and prefix tile): prefixes of none, one and several blocks; suffixes of 1 token, partial and
# several blocks; GQA groups 1, 3 and 4; several row tiles and several splits on both sides.
CASES = {
    "no prefix": (0, [1, 7, 20], 4, 1, None, None, None, None),
    "one block, suffixes of 1": (16, [1, 1, 1], 2, 2, None, None, None, None),
    "several blocks, gqa 3": (48, [1, 9, 16, 30, 2], 6, 2, None, None, None, None),
    "row tiles and splits": (96, [1, 40, 3, 17, 64, 5, 2, 1, 33], 8, 2, 3, 2, (32, 4, 1), (16, 4, 1)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cascade_equals_plain_kernel_and_reference(case: str) -> None:
    prefix_len, suffixes, num_q_heads, num_kv_heads, prefix_splits, splits, config, prefix_config = CASES[case]
    q, k_cache, v_cache, meta = shared_prefix_batch(prefix_len, suffixes, num_q_heads, num_kv_heads)
    scale = q.shape[-1] ** -0.5
    plan = cascade_plan(q, k_cache, meta, prefix_splits, splits, config, prefix_config)
    out = cascade_attention_triton(q, k_cache, v_cache, meta, scale, plan)
    expected = paged_attention_ref(q, k_cache, v_cache, _plain(meta), scale)
    _close(out, expected)
    _close(out, paged_decode_triton(q, k_cache, v_cache, _plain(meta), scale))


def test_cascade_on_a_head_major_pool() -> None:
    """Both passes address the pool through its strides: stored [blocks, heads, block_size, head_dim]
    (ops.kv_pool's default layout) it gives the same bits as on a token-major one."""
    prefix_len, suffixes, num_q_heads, num_kv_heads, prefix_splits, splits, config, prefix_config = \
        CASES["row tiles and splits"]
    q, k_cache, v_cache, meta = shared_prefix_batch(prefix_len, suffixes, num_q_heads, num_kv_heads)
    plan = cascade_plan(q, k_cache, meta, prefix_splits, splits, config, prefix_config)
    out = cascade_attention_triton(q, k_cache, v_cache, meta, 0.2, plan)
    k_major, v_major = head_major(k_cache), head_major(v_cache)
    assert k_major.stride(2) == k_cache.shape[1] * k_cache.shape[3]
    assert torch.equal(cascade_attention_triton(q, k_major, v_major, meta, 0.2, plan), out)


@pytest.mark.parametrize("num_seqs,prefix_splits", [(8, 16), (32, 8), (64, 4), (128, 2), (256, 2)])
def test_cascade_plan_prefix_splits(num_seqs: int, prefix_splits: int) -> None:
    # Llama-3.2-1B's heads in bf16 (64-row prefix tiles): about 128 prefix-pass programs, never fewer than 2 splits
    # (the GPU sweep's best plans)
    q, k_cache, _, meta = shared_prefix_batch(32, [3] * num_seqs, 32, 8)
    plan = cascade_plan(q.to(torch.bfloat16), k_cache.to(torch.bfloat16), meta)
    assert plan.num_prefix_splits == prefix_splits and plan.prefix_config == (64, 4, 2)


# (prefix tokens, suffix lengths, query heads, KV heads, prefix splits, decode tile, prefix tile, idle sequences,
# padding rows): the cases of CASES["row tiles and splits"], and a sequence whose suffix is empty (all its keys in
# the prefix: the engine's common prefix never takes a sequence's newest token, but the kernel takes any prefix)
MERGE_CASES = {
    "row tiles, idle and padding": (96, [1, 40, 3, 17, 64, 5, 2, 1, 33], 8, 2, 3, (16, 4, 1), (32, 4, 1), (2,), 1),
    "an empty suffix": (32, [3, 0, 5], 4, 2, 2, (16, 4, 1), (16, 4, 1), (), 0),
}


@pytest.mark.parametrize("case", list(MERGE_CASES))
def test_suffix_pass_merges_the_prefix_when_each_suffix_is_one_piece(case: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """With one suffix split the suffix pass merges the prefix pass's pieces itself and no combine is launched: the
    same sums in the same order as the combine kernel over the three launches' partials, so the same bits; a
    padding row gets zeros."""
    prefix_len, suffixes, num_q_heads, num_kv_heads, prefix_splits, config, prefix_config, idle, padding = \
        MERGE_CASES[case]
    q, k_cache, v_cache, meta = shared_prefix_batch(prefix_len, suffixes, num_q_heads, num_kv_heads, idle=idle,
                                                    padding=padding)
    plan = cascade_plan(q, k_cache, meta, prefix_splits, 1, config, prefix_config)
    partial_out, partial_lse = cascade_partials_triton(q, k_cache, v_cache, meta, 0.2, plan)
    three = torch.full(q.shape, float("nan"))
    launch_combine(three, partial_out, partial_lse, meta, 1, plan.min_partition, plan.decode_config[0],
                   meta.common_prefix_len, plan.num_prefix_splits)
    combines = []
    monkeypatch.setattr(cascade_attention, "launch_combine", lambda *args, **kwargs: combines.append(args))
    merged = cascade_attention_triton(q, k_cache, v_cache, meta, 0.2, plan)
    assert not combines
    assert torch.equal(merged, three)
    _close(merged, paged_attention_ref(q, k_cache, v_cache, _plain(meta), 0.2))
    if padding:
        assert bool((merged[-padding:] == 0).all())


@pytest.mark.parametrize("kernel", ["triton", "reference"])
def test_attention_writes_into_out(kernel: str) -> None:
    """`out=` (the piecewise CUDA graphs pass their shared buffer): a prefill batch, a decode batch and a cascade
    decode batch each write their result there, equal to the result returned without it."""
    from tinyvllm.ops.attention import paged_attention_triton
    from tinyvllm.ops.cascade_attention import cascade_attention_ref

    plain = paged_attention_triton if kernel == "triton" else paged_attention_ref
    cascade = cascade_attention_triton if kernel == "triton" else cascade_attention_ref
    q, k_cache, v_cache, meta = shared_prefix_batch(32, [3, 1, 20], 4, 2)
    prefill = AttentionMetadata.for_cached([4, 1, 7], [9, 33, 7], meta.block_tables)
    prefill_q = torch.randn(12, 4, q.shape[-1])
    for attend, args in ((plain, (prefill_q, k_cache, v_cache, prefill)), (plain, (q, k_cache, v_cache, _plain(meta))),
                         (cascade, (q, k_cache, v_cache, meta))):
        expected = attend(*args, 0.2)
        out = torch.full(expected.shape, float("nan"))
        assert attend(*args, 0.2, out=out) is out
        _close(out, expected)


def test_cascade_idle_and_padding_rows() -> None:
    """A sequence without a token this step is left alone and a padding row (context 0) gets zeros."""
    q, k_cache, v_cache, meta = shared_prefix_batch(32, [3, 1, 20], 4, 2, idle=(1,), padding=2)
    out = cascade_attention_triton(q, k_cache, v_cache, meta, 0.2)
    _close(out, paged_attention_ref(q, k_cache, v_cache, _plain(meta), 0.2))
    assert bool((out[-2:] == 0).all())


def _check_each_pass(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                     prefix_len: int, scale: float, logit_softcap: float | None = None) -> None:
    """With one split each, slot 0 of the partial results is the prefix pass's and slot 1 the suffix pass's."""
    plan = cascade_plan(q, k_cache, meta, num_prefix_splits=1, num_splits=1)
    partial_out, partial_lse = cascade_partials_triton(q, k_cache, v_cache, meta, scale, plan, logit_softcap)
    prefix_out, prefix_lse = cascade_prefix_ref(q, k_cache, v_cache, meta.block_tables[0], prefix_len, scale,
                                                logit_softcap)
    suffix_out, suffix_lse = cascade_suffix_ref(q, k_cache, v_cache, meta, prefix_len, scale, logit_softcap)
    _close(partial_out[:, :, 0], prefix_out)
    _close(partial_lse[:, :, 0], prefix_lse)
    _close(partial_out[:, :, 1], suffix_out)
    _close(partial_lse[:, :, 1], suffix_lse)


def test_each_pass_against_its_reference() -> None:
    prefix_len = 64
    q, k_cache, v_cache, meta = shared_prefix_batch(prefix_len, [1, 18, 5, 40], 8, 2)
    _check_each_pass(q, k_cache, v_cache, meta, prefix_len, 0.17)


@pytest.mark.usefixtures("fp8_casts_as_on_the_gpu")
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", ["several blocks, gqa 3", "row tiles and splits"])
def test_cascade_with_fp8_cache(case: str, query_dtype: torch.dtype) -> None:
    """kv_cache_dtype="fp8": both passes read the float8 cache as the query's dtype, the references as float32; with
    the same cache and float32 queries they agree as closely as with a float32 cache, each pass and the whole.
    Bfloat16 queries (the model's case, multiplied as float16: attention._query_for): the whole, within bfloat16's
    1e-2 of ||ref||, as the GPU tests judge attention."""
    prefix_len, suffixes, num_q_heads, num_kv_heads, prefix_splits, splits, config, prefix_config = CASES[case]
    q, k_cache, v_cache, meta = shared_prefix_batch(prefix_len, suffixes, num_q_heads, num_kv_heads)
    q, k_cache, v_cache = q.to(query_dtype), k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
    scale = q.shape[-1] ** -0.5
    plan = cascade_plan(q, k_cache, meta, prefix_splits, splits, config, prefix_config)
    out = cascade_attention_triton(q, k_cache, v_cache, meta, scale, plan)
    expected = paged_attention_ref(q.float(), k_cache, v_cache, _plain(meta), scale)
    if query_dtype == torch.bfloat16:
        assert_bf16_attention_close(out, expected)
        return
    _close(out, expected)
    _close(cascade_attention_ref(q, k_cache, v_cache, meta, scale), expected)
    _check_each_pass(q, k_cache, v_cache, meta, prefix_len, scale)


# ------------------------------------------------------------------------ logit soft-capping and sliding windows


@pytest.mark.parametrize("case", list(CASES))
def test_cascade_with_logit_softcap(case: str) -> None:
    """Gemma 2's cap in both passes: the whole (three launches, or two where the suffix pass merges: one suffix
    split) against paged_attention_ref with the cap, and each pass against its reference."""
    prefix_len, suffixes, num_q_heads, num_kv_heads, prefix_splits, splits, config, prefix_config = CASES[case]
    q, k_cache, v_cache, meta = shared_prefix_batch(prefix_len, suffixes, num_q_heads, num_kv_heads, idle=(1,),
                                                    padding=1)
    q = 3 * q  # (scores of a few units, which a cap of 2 bends)
    scale = q.shape[-1] ** -0.5
    expected = paged_attention_ref(q, k_cache, v_cache, _plain(meta), scale, logit_softcap=2.0)
    assert (expected - paged_attention_ref(q, k_cache, v_cache, _plain(meta), scale)).abs().max() > 1e-2
    _close(cascade_attention_ref(q, k_cache, v_cache, meta, scale, logit_softcap=2.0), expected)
    for num_splits in (splits, 1):
        plan = cascade_plan(q, k_cache, meta, prefix_splits, num_splits, config, prefix_config)
        _close(cascade_attention_triton(q, k_cache, v_cache, meta, scale, plan, logit_softcap=2.0), expected)
    if prefix_len:
        q, k_cache, v_cache, meta = shared_prefix_batch(prefix_len, suffixes, num_q_heads, num_kv_heads)
        _check_each_pass(3 * q, k_cache, v_cache, meta, prefix_len, scale, logit_softcap=2.0)


def test_window_allows_cascade() -> None:
    # the prefix pass shows every query the whole prefix: right only where no context outgrows the window
    assert window_allows_cascade(4096, None)
    assert window_allows_cascade(4096, 4096) and window_allows_cascade(100, 4096)
    assert not window_allows_cascade(4097, 4096)


def test_paged_attention_with_a_window_and_a_common_prefix() -> None:
    """ops.paged_attention on a decode step with a common prefix (the CPU runs the references): with a window shorter
    than the longest context it takes the plain path, which applies the window (the cascade path would show the
    queries the whole prefix); with one that no context outgrows the result is the same either way. The cap reaches
    both paths."""
    import tinyvllm.ops as ops

    q, k_cache, v_cache, meta = shared_prefix_batch(64, [1, 20, 40], 4, 2, idle=(1,), padding=1)
    q = 3 * q
    longest = meta.max_context_len
    unwindowed = paged_attention_ref(q, k_cache, v_cache, _plain(meta), 0.2)
    for window in (20, longest - 1, longest, 10 * longest):
        for softcap in (None, 2.0):
            out = ops.paged_attention(q, k_cache, v_cache, meta, 0.2, sliding_window=window, logit_softcap=softcap)
            _close(out, paged_attention_ref(q, k_cache, v_cache, _plain(meta), 0.2, sliding_window=window,
                                            logit_softcap=softcap))
            if window < longest:  # (the longest sequence's first key hidden)
                assert (out - unwindowed).abs().max() > 1e-4, (window, softcap)


def test_use_cascade_attention_thresholds() -> None:
    assert use_cascade_attention(CASCADE_MIN_PREFIX_TOKENS, CASCADE_MIN_SEQS)
    assert not use_cascade_attention(CASCADE_MIN_PREFIX_TOKENS - BLOCK_SIZE, 256)
    assert not use_cascade_attention(4096, CASCADE_MIN_SEQS - 1)


# ----------------------------------------------------------------------------------------- the common prefix


def test_common_prefix_len() -> None:
    tables = np.array([[5, 6, 7, 8, 9], [5, 6, 7, 10, 11], [5, 6, 7, 8, 12]])
    assert common_prefix_len(tables, np.array([80, 80, 80]), 16) == 48  # the fourth block differs in row 1
    assert common_prefix_len(tables[[0, 2]], np.array([80, 80]), 16) == 64
    # whole blocks only, short of each sequence's newest token: a context of 49 keeps block 3 (token 48) its own
    assert common_prefix_len(tables[[0, 2]], np.array([49, 80]), 16) == 48
    assert common_prefix_len(tables[[0, 2]], np.array([48, 80]), 16) == 32  # token 47, the newest, ends block 2
    assert common_prefix_len(tables[[0, 2]], np.array([16, 80]), 16) == 0
    assert common_prefix_len(np.array([[1, 2], [3, 2]]), np.array([40, 40]), 16) == 0  # different tables
    assert common_prefix_len(tables[:1], np.array([80]), 16) == 64


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama whose context holds prompts past cascade attention's threshold, whatever it is tuned to."""
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny")), seed=11,
                           max_position_embeddings=max(512, 2 * CASCADE_MIN_PREFIX_TOKENS + 128))


def _new_seq(seq_id: int, context_len: int, block_ids: list[int]) -> NewSequence:
    """A sequence the runner has not seen, all but its newest token cached: its next step is a decode."""
    return NewSequence(seq_id, [3] * context_len, context_len, context_len - 1, block_ids,
                       SamplingParams(temperature=0), 0, ())


def test_prepare_sets_common_prefix_len(checkpoint: str) -> None:
    runner = tiny_llm(checkpoint, num_kv_blocks=256).llm_engine.engine_core.model_runner
    prefix_blocks = CASCADE_MIN_PREFIX_TOKENS // BLOCK_SIZE
    shared = list(range(prefix_blocks))
    n = CASCADE_MIN_SEQS
    ids = iter(range(1000))
    done: list[int] = []

    def step(contexts: list[int], tables: list[list[int]]) -> int | None:
        seqs = [_new_seq(next(ids), c, t) for c, t in zip(contexts, tables)]
        meta = runner.prepare(SchedulerOutput([s.seq_id for s in seqs], [1] * len(seqs), seqs, {}, done[:])).meta
        done[:] = [s.seq_id for s in seqs]  # (the next step frees their rows)
        return None if meta.common_prefix_len is None else int(meta.common_prefix_len[0])

    own = [[prefix_blocks + 2 * i, prefix_blocks + 2 * i + 1] for i in range(n)]
    context = CASCADE_MIN_PREFIX_TOKENS + 20
    assert step([context] * n, [shared + o for o in own]) == CASCADE_MIN_PREFIX_TOKENS
    # one sequence too few
    assert step([context] * (n - 1), [shared + o for o in own[: n - 1]]) is None
    # one sequence's context ends inside the shared blocks: what all hold whole falls below the threshold
    short = [context] * (n - 1) + [CASCADE_MIN_PREFIX_TOKENS]
    assert step(short, [shared + o for o in own[: n - 1]] + [shared]) is None
    # one sequence's table differs in its first block
    other = [[200] + shared[1:] + own[-1]]
    assert step([context] * n, [shared + o for o in own[: n - 1]] + other) is None


def test_prepare_without_cascade(checkpoint: str) -> None:
    runner = tiny_llm(checkpoint, num_kv_blocks=256, cascade_attention=False).llm_engine.engine_core.model_runner
    prefix_blocks = CASCADE_MIN_PREFIX_TOKENS // BLOCK_SIZE
    seqs = [_new_seq(i, CASCADE_MIN_PREFIX_TOKENS + 5, list(range(prefix_blocks)) + [prefix_blocks + i])
            for i in range(CASCADE_MIN_SEQS)]
    meta = runner.prepare(SchedulerOutput([s.seq_id for s in seqs], [1] * len(seqs), seqs)).meta
    assert meta.common_prefix_len is None


# ------------------------------------------------------------------------------------------------- the engine


def record_prefixes(llm: object) -> list[int]:
    """The common_prefix_len of every step the engine's model runner prepares from now on."""
    runner = llm.llm_engine.engine_core.model_runner
    prefixes: list[int] = []
    prepare = runner.prepare

    def recording_prepare(step: SchedulerOutput):
        inputs = prepare(step)
        if inputs.meta.common_prefix_len is not None:
            prefixes.append(int(inputs.meta.common_prefix_len[0]))
        return inputs

    runner.prepare = recording_prepare
    return prefixes


def test_engine_greedy_same_with_cascade_on_and_off(checkpoint: str) -> None:
    """Requests sharing a cached prefix decode through cascade attention (the CPU runs its reference), with the
    same greedy tokens as without it."""
    rng = random.Random(3)
    system = [rng.randrange(2, 256) for _ in range(CASCADE_MIN_PREFIX_TOKENS + 40)]
    prompts = [system + [rng.randrange(2, 256) for _ in range(rng.randint(1, 20))]
               for _ in range(CASCADE_MIN_SEQS + 2)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    results = {}
    for cascade in (True, False):
        llm = tiny_llm(checkpoint, num_kv_blocks=512, cascade_attention=cascade)
        prefixes = record_prefixes(llm)
        llm.generate(prompts[:1], params, use_tqdm=False)  # the system prompt is cached, as a server's would be
        outputs = llm.generate(prompts[1:], params, use_tqdm=False)
        results[cascade] = [o.outputs[0].token_ids for o in outputs]
        if cascade:
            assert prefixes and set(prefixes) == {len(system) // BLOCK_SIZE * BLOCK_SIZE}, prefixes
        else:
            assert not prefixes
    assert results[True] == results[False]


def test_tensor_parallel_ranks_take_the_common_prefix(checkpoint: str) -> None:
    """With two ranks the common prefix travels in the step's staged buffer to rank 1, which runs cascade
    attention on its heads too: greedy tokens equal one rank's."""
    rng = random.Random(4)
    system = [rng.randrange(2, 256) for _ in range(CASCADE_MIN_PREFIX_TOKENS + 16)]
    prompts = [system + [rng.randrange(2, 256) for _ in range(rng.randint(1, 9))] for _ in range(CASCADE_MIN_SEQS + 1)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    results = []
    for size in (1, 2):
        llm = tiny_llm(checkpoint, num_kv_blocks=256, tensor_parallel_size=size)
        try:
            prefixes = record_prefixes(llm)
            llm.generate(prompts[:1], params, use_tqdm=False)
            results.append([o.outputs[0].token_ids for o in llm.generate(prompts[1:], params, use_tqdm=False)])
            assert prefixes, f"no step of {size} rank(s) took cascade attention"
        finally:
            llm.llm_engine.shutdown()
    assert results[0] == results[1]
