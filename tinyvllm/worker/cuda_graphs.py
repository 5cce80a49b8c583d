"""CUDA graphs: whole decode steps (CudaGraphs), and the pieces between attention calls of steps that hold
prompt tokens (PiecewiseCudaGraphs).

A decode step of a small model is tens of kernel launches per layer: on a slow host CPU, launching them
costs more than running them. Each batch size of a ladder gets a graph captured once, over persistent
input buffers; a step copies its inputs into the buffers (padding rows write nowhere: slot -1, context 0)
and replays the graph of the next size up. Sizes where cascade attention may apply get a second graph, captured
with it: a step whose sequences share a prefix (AttentionMetadata.common_prefix_len) replays that one, its
prefix length copied into a buffer of its own.

Given a tail (the model runner's draw of tokens from hidden states), each also gets graphs that end in the step's
tokens, the LM head and the sampler included, so that a decode step launches one graph and nothing after it
but the tokens' copy to the host: one for greedy steps, and one for steps that sample with temperature and
min-p alone (their parameters copied into buffers too). Steps that need more (top-k or top-p, whose path
depends on the values; logprobs, penalties, min_tokens, which the host applies) replay the graph that ends in
hidden states, and sample after it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tinyvllm import ops
from tinyvllm.ops import AttentionMetadata
from tinyvllm.ops.cascade_attention import CASCADE_MIN_SEQS
from tinyvllm.worker.sampler import SamplingTensors

# What a graph ends in: hidden states (None), or tokens of an all-greedy step, or of one that samples
TAIL_MODES = (None, "greedy", "sample")
Tail = Callable[[torch.Tensor, SamplingTensors], torch.Tensor]


def size_ladder(max_size: int) -> list[int]:
    """The batch sizes a step is padded up to for a fixed shape: 1, 2, 4, 8, then every 16, and max_size."""
    return sorted({b for b in (1, 2, 4, 8) if b < max_size} | set(range(16, max_size, 16)) | {max_size})


class CudaGraphs:
    @torch.inference_mode()
    def __init__(self, model: torch.nn.Module, max_num_seqs: int, max_blocks_per_seq: int, block_size: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device, cascade: bool = False,
                 tail: Tail | None = None) -> None:
        max_bs = min(max_num_seqs, 512)
        self.batch_sizes = size_ladder(max_bs)
        self.buffers = dict(
            input_ids=torch.zeros(max_bs, dtype=torch.int64, device=device),
            positions=torch.zeros(max_bs, dtype=torch.int64, device=device),
            slot_mapping=torch.full((max_bs,), -1, dtype=torch.int64, device=device),
            context_lens=torch.zeros(max_bs, dtype=torch.int32, device=device),
            block_tables=torch.zeros(max_bs, max_blocks_per_seq, dtype=torch.int32, device=device),
            cu_query_lens=torch.arange(max_bs + 1, dtype=torch.int32, device=device),
            common_prefix_len=torch.zeros(1, dtype=torch.int32, device=device),
            temperature=torch.zeros(max_bs, dtype=torch.float32, device=device),
            min_p=torch.zeros(max_bs, dtype=torch.float32, device=device),
            seeds=torch.zeros(max_bs, dtype=torch.int64, device=device),
            top_k=torch.zeros(max_bs, dtype=torch.int64, device=device),  # (off, for every row)
            top_p=torch.ones(max_bs, dtype=torch.float32, device=device),
        )
        b = self.buffers
        self.outputs = torch.zeros(max_bs, hidden_size, dtype=dtype, device=device)
        self.tokens = torch.zeros(max_bs, dtype=torch.int64, device=device)
        # (batch size, captured with a common prefix, tail mode) -> graph
        self.graphs: dict[tuple[int, bool, str | None], torch.cuda.CUDAGraph] = {}
        pool = None
        for bs in reversed(self.batch_sizes):
            for shared in (False, True) if cascade and bs >= CASCADE_MIN_SEQS else (False,):
                meta = AttentionMetadata(b["cu_query_lens"][: bs + 1], b["context_lens"][:bs],
                                         b["block_tables"][:bs], b["slot_mapping"][:bs], max_query_len=1,
                                         max_context_len=max_blocks_per_seq * block_size,
                                         common_prefix_len=b["common_prefix_len"] if shared else None)
                args = (b["input_ids"][:bs], b["positions"][:bs], meta)
                for mode in TAIL_MODES if tail is not None else (None,):
                    sampling = self._sampling(mode, bs)
                    self._step(model, args, bs, tail if mode else None, sampling)  # warm-up: compiles outside
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self._step(model, args, bs, tail if mode else None, sampling)
                    pool = graph.pool()
                    self.graphs[bs, shared, mode] = graph
        self.has_tails = tail is not None
        self.pool = pool  # (the piecewise graphs share it: no two graphs ever run at once)
        for graph in self.graphs.values():
            graph.replay()  # the first replay uploads the graph to the device: pay for it now, not mid-run
        torch.cuda.synchronize()

    def _step(self, model: torch.nn.Module, args: tuple, bs: int, tail: Tail | None, sampling: SamplingTensors) -> None:
        """What a graph of batch size bs runs: the layers into the hidden-states buffer, or with a tail on to the
        tokens buffer."""
        hidden = model(*args)
        if tail is None:
            self.outputs[:bs] = hidden
        else:
            self.tokens[:bs] = tail(hidden, sampling)

    def _sampling(self, mode: str | None, bs: int) -> SamplingTensors:
        """The sampling tensors a tail of this mode is captured with: the buffers, and fixed hints."""
        if mode != "sample":
            return SamplingTensors.greedy()
        b = self.buffers
        return SamplingTensors(b["temperature"][:bs], b["top_k"][:bs], b["top_p"][:bs], b["min_p"][:bs],
                               b["seeds"][:bs], all_greedy=False, use_top_p=False, max_top_k=0, use_min_p=True)

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.batch_sizes[-1]

    def tail_mode(self, sampling: SamplingTensors) -> str | None:
        """Which graph a decode step in which every sequence samples can end in: its tokens, from a greedy or a
        temperature-and-min-p tail, or None: its hidden states."""
        if not self.has_tails or sampling.needs_host_pass:
            return None
        if sampling.all_greedy:
            return "greedy"
        return "sample" if not sampling.use_top_p and sampling.max_top_k == 0 else None

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
               mode: str | None = None, sampling: SamplingTensors | None = None) -> torch.Tensor:
        """A decode step (one token per sequence) through the graph of its size: its hidden states, or with a
        tail `mode` (tail_mode(sampling)) its tokens. Both are buffers that the next replay overwrites, in stream
        order: after what the caller queued to read them."""
        num_seqs = input_ids.shape[0]
        bs = next(b for b in self.batch_sizes if b >= num_seqs)
        b = self.buffers
        b["input_ids"][:num_seqs] = input_ids
        b["positions"][:num_seqs] = positions
        b["slot_mapping"][:num_seqs] = meta.slot_mapping
        b["slot_mapping"][num_seqs:bs] = -1
        b["context_lens"][:num_seqs] = meta.context_lens
        b["context_lens"][num_seqs:bs] = 0
        b["block_tables"][:num_seqs, : meta.block_tables.shape[1]] = meta.block_tables
        shared = meta.common_prefix_len is not None and (bs, True, None) in self.graphs
        if shared:
            b["common_prefix_len"].copy_(meta.common_prefix_len)
        if mode == "sample":
            assert sampling is not None
            b["temperature"][:num_seqs] = sampling.temperature
            b["min_p"][:num_seqs] = sampling.min_p
            b["seeds"][:num_seqs] = sampling.seeds
        self.graphs[bs, shared, mode].replay()
        return self.outputs[:num_seqs] if mode is None else self.tokens[:num_seqs]


@dataclass
class _Pieces:
    """One token count's capture: graphs[i] runs up to attention call i (graphs[-1] to the end), whose KV
    caches and scale attention[i] holds; output is the hidden states the last graph writes (pool memory,
    overwritten by the next replay of any graph: read it before then)."""

    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    attention: list[tuple[torch.Tensor, torch.Tensor, float]] = field(default_factory=list)
    output: torch.Tensor | None = None


PIECEWISE_MAX_TOKENS = 2048  # the largest step the piecewise graphs take


class PiecewiseCudaGraphs:
    """CUDA graphs for steps with prompt tokens (a prompt chunk among decodes, as a server's steps are while
    requests keep arriving), up to a few thousand tokens: everything but attention, one graph per piece between
    two attention calls, per token count of a ladder. Attention runs eagerly between the pieces, with the step's
    own metadata (its grid depends on the sequences and their query lengths, which a graph cannot change). So
    such a step costs a replay and an attention launch per layer instead of tens of launches: on a slow host,
    launching an eager step took longer than the GPU ran it. Padding tokens (to the ladder's size) store no K/V
    (slot -1) and attend to nothing; every other op works row by row, so they cannot touch the real ones."""

    @torch.inference_mode()
    def __init__(self, model: torch.nn.Module, max_num_tokens: int, device: torch.device,
                 pool: tuple[int, int] | None = None) -> None:
        ladder = [*range(64, 512, 64), *range(512, 1024, 128), *range(1024, PIECEWISE_MAX_TOKENS + 1, 256)]
        self.token_counts = sorted({t for t in ladder if t < max_num_tokens}
                                   | {min(max_num_tokens, PIECEWISE_MAX_TOKENS)})
        top = self.token_counts[-1]
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((top,), -1, dtype=torch.int64, device=device)
        # Attention's query and output, one pair shared by every layer and token count (pieces run one at a
        # time): allocated in the first warm-up, when their shape is known.
        self.query: torch.Tensor | None = None
        self.attn_out: torch.Tensor | None = None
        self.pieces: dict[int, _Pieces] = {}
        self.pool = pool
        empty = torch.zeros(1, dtype=torch.int32, device=device)
        for count in reversed(self.token_counts):
            args = (self.input_ids[:count], self.positions[:count])

            def meta(attention: Callable[..., torch.Tensor], count: int = count) -> AttentionMetadata:
                """Only slot_mapping is read inside the pieces (by the K/V store); attention is `attention`."""
                return AttentionMetadata(empty, empty, empty.view(1, 1), self.slot_mapping[:count], 1, 1, attention)

            model(*args, meta(self._warm_up_attention))  # compiles the kernels outside the capture
            self.pieces[count] = self._capture(model, args, meta)
        for pieces in self.pieces.values():
            for graph in pieces.graphs:
                graph.replay()  # the first replay uploads the graph: pay for it now, not mid-run
        torch.cuda.synchronize()

    def _warm_up_attention(self, q: torch.Tensor, *rest: object) -> torch.Tensor:
        """Attention in the warm-up runs (the largest count first): allocates the query and output buffers."""
        if self.query is None:
            self.query = torch.empty((self.token_counts[-1], *q.shape[1:]), dtype=q.dtype, device=q.device)
            self.attn_out = torch.empty_like(self.query)
        return torch.zeros_like(q)

    def _capture(self, model: torch.nn.Module, args: tuple,
                 meta: Callable[[Callable[..., torch.Tensor]], AttentionMetadata]) -> _Pieces:
        pieces = _Pieces()
        stream = torch.cuda.Stream()
        torch.cuda.synchronize()

        def begin() -> None:
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self.pool)
            pieces.graphs.append(graph)

        def cut(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, _meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
            count = q.shape[0]
            assert self.query is not None and self.attn_out is not None and self.query.shape[1:] == q.shape[1:]
            self.query[:count].copy_(q)  # (in the piece: the query it leaves for attention)
            pieces.graphs[-1].capture_end()
            self.pool = pieces.graphs[-1].pool()
            pieces.attention.append((k_cache, v_cache, scale))
            begin()
            return self.attn_out[:count]

        with torch.cuda.stream(stream):
            begin()
            pieces.output = model(*args, meta(cut))
            pieces.graphs[-1].capture_end()
            self.pool = pieces.graphs[-1].pool()
        torch.cuda.synchronize()
        return pieces

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.token_counts[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The hidden states of a step of `num_tokens` tokens, through the pieces of the next count up."""
        n = input_ids.shape[0]
        count = next(t for t in self.token_counts if t >= n)
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = meta.slot_mapping
        self.slot_mapping[n:count] = -1
        pieces = self.pieces[count]
        assert self.query is not None and self.attn_out is not None
        for graph, (k_cache, v_cache, scale) in zip(pieces.graphs, pieces.attention):
            graph.replay()
            self.attn_out[:n] = ops.paged_attention(self.query[:n], k_cache, v_cache, meta, scale)
        pieces.graphs[-1].replay()
        assert pieces.output is not None
        return pieces.output[:n]
