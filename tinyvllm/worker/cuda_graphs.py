"""CUDA graphs: whole decode steps (CudaGraphs), and the pieces between attention calls of steps that hold
prompt tokens, or whole steps where those are one sequence's (PiecewiseCudaGraphs).

A decode step of a small model is tens of kernel launches per layer: on a slow host CPU, launching them
costs more than running them. Each batch size of a ladder gets a graph captured once, over one persistent
input buffer (DecodeInputs); a step packs its inputs on the host in that buffer's layout, copies them in at
once (padding rows write nowhere: slot -1, context 0) and replays the graph of the next size up. The graph's
first op completes the inputs on the device (ops.unpack_decode_inputs: tokens still in flight, block tables),
so nothing but that one copy runs before it. Sizes where cascade attention may apply get a second graph, captured
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
from typing import Any

import numpy as np
import torch

from tinyvllm import ops
from tinyvllm.ops import AttentionMetadata
from tinyvllm.ops.cascade_attention import CASCADE_MIN_SEQS
from tinyvllm.worker.sampler import SamplingTensors
from tinyvllm.worker.staging import DTYPE_CODES, TORCH_DTYPES, Staging

# What a graph ends in: hidden states (None), or tokens of an all-greedy step, or of one that samples
TAIL_MODES = (None, "greedy", "sample")
Tail = Callable[[torch.Tensor, SamplingTensors], torch.Tensor]


class DecodeInputs:
    """The decode graphs' inputs, in one device buffer of fixed layout: a field per input, each sized for the
    largest batch, and last the block tables packed as [B, width] (so a step copies only the part it uses of
    them). A step packs its arrays into a pinned host buffer in this layout (pack) and copies them in at once
    (upload); the graph's first op (unpack) takes its tokens in flight from the step before and the block tables
    into their [B, max_blocks] buffer. The rows past a step's sequences get values that read and write nothing
    (ROW_FIELDS' padding), so any graph may replay over the last upload."""

    # (name, dtype, padding value) of each per-row field; then common_prefix_len and width, [1] int32 each.
    ROW_FIELDS = (("input_ids", np.int64, 0), ("positions", np.int64, 0), ("slot_mapping", np.int64, -1),
                  ("pending", np.int64, -1), ("logits_indices", np.int64, 0), ("seeds", np.int64, 0),
                  ("top_k", np.int64, 0), ("context_lens", np.int32, 0), ("temperature", np.float32, 0.0),
                  ("top_p", np.float32, 1.0), ("min_p", np.float32, 0.0))
    ALIGN = 16

    def __init__(self, max_bs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.max_bs = max_bs
        fields = [(name, dtype, max_bs) for name, dtype, _ in self.ROW_FIELDS]
        fields += [("common_prefix_len", np.int32, 1), ("width", np.int32, 1),
                   ("block_tables", np.int32, max_bs * max_blocks_per_seq)]
        self.offsets: dict[str, int] = {}
        offset = 0
        for name, dtype, count in fields:
            self.offsets[name] = offset
            offset += -(-count * np.dtype(dtype).itemsize // self.ALIGN) * self.ALIGN
        self.nbytes = offset
        self.buffer = torch.zeros(offset, dtype=torch.uint8, device=device)
        self.fields = {name: self.buffer[self.offsets[name]:self.offsets[name] + count * np.dtype(dtype).itemsize]
                       .view(TORCH_DTYPES[DTYPE_CODES[np.dtype(dtype)]]) for name, dtype, count in fields}
        for name, _, pad in self.ROW_FIELDS:
            self.fields[name].fill_(pad)
        self.block_tables = torch.zeros(max_bs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.cu_query_lens = torch.arange(max_bs + 1, dtype=torch.int32, device=device)

    def pack(self, host: np.ndarray, arrays: dict[str, np.ndarray]) -> int:
        """Write a decode step's arrays (a row each per sequence, or per sampled row; block_tables [n, width]) into
        `host` (bytes, at least self.nbytes long) for a graph of size bs; the bytes to copy (every per-row field
        whole, then the tables' n rows). Each per-row field is written for all max_bs rows, past the step's own
        with padding (a field the step lacks, all padding: the host buffer holds whatever was packed in it before),
        so that a graph of any size reads only valid rows; common_prefix_len only where the step has one (only its
        graph reads it)."""
        for name, dtype, pad in self.ROW_FIELDS:
            field = host[self.offsets[name]:self.offsets[name] + self.max_bs * np.dtype(dtype).itemsize].view(dtype)
            a = arrays.get(name)
            filled = 0 if a is None else len(a)
            if filled:
                field[:filled] = a
            field[filled:] = pad
        if "common_prefix_len" in arrays:
            host[self.offsets["common_prefix_len"]:][:4].view(np.int32)[0] = arrays["common_prefix_len"][0]
        tables = np.ascontiguousarray(arrays["block_tables"], dtype=np.int32)
        host[self.offsets["width"]:][:4].view(np.int32)[0] = tables.shape[1]
        start = self.offsets["block_tables"]
        host[start:start + tables.nbytes] = tables.view(np.uint8).reshape(-1)
        return start + tables.nbytes

    def upload(self, staging: Staging, arrays: dict[str, np.ndarray]) -> None:
        """Pack a step's arrays (pack) in the staging's next pinned buffer and copy them into the device buffer."""
        staging.send(self.pack(staging.host_buffer(self.nbytes), arrays), out=self.buffer)

    def unpack(self, bs: int, tokens: torch.Tensor) -> None:
        """The graph's first op: inputs in flight from `tokens` (the step before's), block tables unpacked."""
        f = self.fields
        ops.unpack_decode_inputs(f["input_ids"][:bs], f["pending"][:bs], tokens, f["block_tables"], f["width"],
                                 self.block_tables[:bs])

    def metadata(self, bs: int, shared: bool, max_context_len: int) -> AttentionMetadata:
        f = self.fields
        return AttentionMetadata(self.cu_query_lens[: bs + 1], f["context_lens"][:bs], self.block_tables[:bs],
                                 f["slot_mapping"][:bs], max_query_len=1, max_context_len=max_context_len,
                                 common_prefix_len=f["common_prefix_len"] if shared else None)


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
        self.inputs = DecodeInputs(max_bs, max_blocks_per_seq, device)
        self.outputs = torch.zeros(max_bs, hidden_size, dtype=dtype, device=device)
        # Every step's sampled tokens, in the order of its sampled sequences: the graphs' tails write them here,
        # and the model runner copies those of other steps here (keep_tokens), for the next graph's inputs in flight.
        # (Sized for the most tokens a step samples, one per sequence: a step too big for a graph may come before.)
        self.tokens = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self.max_context_len = max_blocks_per_seq * block_size
        # (batch size, captured with a common prefix, tail mode) -> graph
        self.graphs: dict[tuple[int, bool, str | None], torch.cuda.CUDAGraph] = {}
        self.has_tails = tail is not None
        self.pool: tuple[int, int] | None = None  # (the piecewise graphs share it: no two graphs ever run at once)
        # Every graph is captured on this one stream (the piecewise graphs too): the caching allocator reuses a freed
        # block only for an allocation on the stream it was made on, so graphs captured on streams of their own
        # could not share the pool's memory at all, and each would hold its own. (None off CUDA: the CPU tests
        # run this class's step logic with capture replaced.)
        self.stream = torch.cuda.Stream(device) if torch.device(device).type == "cuda" else None
        for bs in reversed(self.batch_sizes):
            for shared in (False, True) if cascade and bs >= CASCADE_MIN_SEQS else (False,):
                for mode in TAIL_MODES if tail is not None else (None,):
                    args = (model, bs, shared, tail if mode else None, self._sampling(mode, bs))
                    self.graphs[bs, shared, mode] = self._capture(lambda args=args: self._step(*args))
        self._upload()

    def _capture(self, step: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """A graph of `step`, run once before (so that it compiles outside the capture)."""
        step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            step()
        self.pool = graph.pool()
        return graph

    def _upload(self) -> None:
        for graph in self.graphs.values():
            graph.replay()  # the first replay uploads the graph to the device: pay for it now, not mid-run
        torch.cuda.synchronize()

    def _step(self, model: torch.nn.Module, bs: int, shared: bool, tail: Tail | None,
              sampling: SamplingTensors) -> None:
        """What a graph of batch size bs runs: its inputs completed, the layers into the hidden-states buffer, or
        with a tail on to the tokens buffer."""
        self.inputs.unpack(bs, self.tokens)
        f = self.inputs.fields
        hidden = model(f["input_ids"][:bs], f["positions"][:bs], self.inputs.metadata(bs, shared, self.max_context_len))
        if tail is None:
            self.outputs[:bs] = hidden
        else:
            self.tokens[:bs] = tail(hidden, sampling)

    def _sampling(self, mode: str | None, bs: int) -> SamplingTensors:
        """The sampling tensors a tail of this mode is captured with: the input fields, and fixed hints."""
        if mode != "sample":
            return SamplingTensors.greedy()
        return self.sampling(bs, SamplingTensors(None, None, None, None, None, all_greedy=False, use_top_p=False,
                                                 max_top_k=0, use_min_p=True))

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

    def batch_size(self, num_seqs: int) -> int:
        """The graph size a decode step of num_seqs sequences runs at (fits(num_seqs) first)."""
        return next(b for b in self.batch_sizes if b >= num_seqs)

    def sampling(self, num_rows: int, hints: SamplingTensors) -> SamplingTensors:
        """`hints` with the first num_rows rows of the parameter fields: a step's, whose inputs were uploaded
        (DecodeInputs.upload), for sampling after a graph that ends in hidden states; or a tail's, captured."""
        if hints.all_greedy:
            return hints
        f = self.inputs.fields
        return hints.with_tensors(f["temperature"][:num_rows], f["top_k"][:num_rows], f["top_p"][:num_rows],
                                  f["min_p"][:num_rows], f["seeds"][:num_rows])

    def replay(self, bs: int, shared: bool, mode: str | None = None) -> torch.Tensor:
        """A decode step through the graph of size bs, its inputs uploaded (DecodeInputs.upload; shared: they hold
        a common prefix length, and a graph captured with one exists). Returns the hidden states of the bs rows,
        or with a tail `mode` (tail_mode) their tokens: buffers that the next replay overwrites, in stream order
        (after what the caller queued to read them)."""
        shared = shared and (bs, True, None) in self.graphs
        self.graphs[bs, shared, mode].replay()
        return self.outputs[:bs] if mode is None else self.tokens[:bs]

    def keep_tokens(self, token_ids: torch.Tensor) -> None:
        """A step's tokens sampled outside a graph's tail: where the next graph looks for its inputs in flight."""
        self.tokens[: token_ids.shape[0]].copy_(token_ids)


@dataclass
class _Pieces:
    """One token count's capture: graphs[i] runs up to attention call i (graphs[-1] to the end), whose KV
    caches, scale and keywords (the layer's sliding window, logit soft-cap) attention[i] holds; output is the hidden
    states the last graph writes (pool memory, overwritten by the next replay of any graph: read it before then)."""

    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    attention: list[tuple[torch.Tensor, torch.Tensor, float, dict[str, Any]]] = field(default_factory=list)
    output: torch.Tensor | None = None


PIECEWISE_MAX_TOKENS = 8192  # the largest step the piecewise graphs take (max_num_batched_tokens' default)
# One sequence's prompt steps up to this many tokens (a request's first step when it comes alone, as at low load)
# are whole graphs, attention inside: its grid is fixed by the token count once the batch is one sequence.
WHOLE_GRAPH_MAX_TOKENS = 2048


def graph_token_counts(max_num_tokens: int, table_tokens: int) -> tuple[list[int], list[int]]:
    """The token counts of the piecewise graphs (a ladder up to max_num_tokens, at most PIECEWISE_MAX_TOKENS), and
    those of them that also get a whole graph: up to WHOLE_GRAPH_MAX_TOKENS and to the tokens one sequence's block
    table holds, table_tokens (no step of one sequence holds more, and a graph for more would read past its table;
    0: no whole graphs)."""
    ladder = [*range(64, 512, 64), *range(512, 1024, 128), *range(1024, 2048, 256),
              *range(2048, PIECEWISE_MAX_TOKENS + 1, 512)]
    counts = sorted({t for t in ladder if t < max_num_tokens} | {min(max_num_tokens, PIECEWISE_MAX_TOKENS)})
    return counts, [t for t in counts if t <= min(WHOLE_GRAPH_MAX_TOKENS, table_tokens)]


class PiecewiseCudaGraphs:
    """CUDA graphs for steps with prompt tokens (a prompt chunk among decodes, as a server's steps are while
    requests keep arriving, or a whole budget of prompt tokens), up to PIECEWISE_MAX_TOKENS tokens: everything but
    attention, one graph per piece between two attention calls, per token count of a ladder. Attention runs
    eagerly between the pieces, with the step's own metadata (its grid depends on the sequences and their query
    lengths, which a graph cannot change). So such a step costs a replay and an attention launch per layer
    instead of tens of launches: on a slow host, launching an eager step took longer than the GPU ran it, and a
    step of prompts launched after the step before had finished on the GPU (async scheduling hides only what is
    shorter than that step). Padding tokens (to the ladder's size) store no K/V (slot -1) and attend to nothing;
    every other op works row by row, so they cannot touch the real ones.

    A step of one sequence alone up to WHOLE_GRAPH_MAX_TOKENS and the tokens of its block table (max_blocks_per_seq
    blocks of block_size; 0 blocks: no whole graphs) is one graph, attention included: with one sequence, the
    prefill kernel's grid depends on the token count alone (its query tiles past the sequence's length return at
    once), and the sequence's lengths and block table are read from buffers of the graph's own. That is a request's
    first step whenever it arrives alone: its host work falls from a replay and an attention launch per layer to one
    replay and a few copies (benchmarks/RESULTS.md has the figures)."""

    @torch.inference_mode()
    def __init__(self, model: torch.nn.Module, max_num_tokens: int, device: torch.device,
                 pool: tuple[int, int] | None, max_blocks_per_seq: int, block_size: int,
                 stream: torch.cuda.Stream | None) -> None:
        """pool, stream: the decode graphs' (CudaGraphs.pool, .stream), so that all share one pool's memory."""
        self.token_counts, whole_counts = graph_token_counts(max_num_tokens, max_blocks_per_seq * block_size)
        self.stream = stream
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
        # One sequence's attention metadata, in buffers that its whole graphs read
        self.cu_query_lens = torch.zeros(2, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(1, max(max_blocks_per_seq, 1), dtype=torch.int32, device=device)
        self.whole: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # count -> (graph, its output)
        for count in reversed(whole_counts):
            self.whole[count] = self._capture_whole(model, count)
        graphs = [g for pieces in self.pieces.values() for g in pieces.graphs] + [g for g, _ in self.whole.values()]
        for graph in graphs:
            graph.replay()  # the first replay uploads the graph: pay for it now, not mid-run
        torch.cuda.synchronize()

    def _capture_whole(self, model: torch.nn.Module, count: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """A graph of the whole forward pass of one sequence's `count` tokens (run once before, so that it compiles
        outside the capture; its slots are -1, so neither run stores K/V)."""
        self.cu_query_lens[1] = count
        self.context_lens[0] = count
        meta = AttentionMetadata(self.cu_query_lens, self.context_lens, self.block_tables, self.slot_mapping[:count],
                                 max_query_len=count, max_context_len=count)
        args = (self.input_ids[:count], self.positions[:count], meta)
        model(*args)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            output = model(*args)
        self.pool = graph.pool()
        return graph, output

    def _warm_up_attention(self, q: torch.Tensor, *rest: object, **options: object) -> torch.Tensor:
        """Attention in the warm-up runs (the largest count first): allocates the query and output buffers."""
        if self.query is None:
            self.query = torch.empty((self.token_counts[-1], *q.shape[1:]), dtype=q.dtype, device=q.device)
            self.attn_out = torch.empty_like(self.query)
        return torch.zeros_like(q)

    def _capture(self, model: torch.nn.Module, args: tuple,
                 meta: Callable[[Callable[..., torch.Tensor]], AttentionMetadata]) -> _Pieces:
        pieces = _Pieces()
        torch.cuda.synchronize()

        def begin() -> None:
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self.pool)
            pieces.graphs.append(graph)

        def cut(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, _meta: AttentionMetadata,
                scale: float, **options: Any) -> torch.Tensor:
            count = q.shape[0]
            assert self.query is not None and self.attn_out is not None and self.query.shape[1:] == q.shape[1:]
            self.query[:count].copy_(q)  # (in the piece: the query it leaves for attention)
            pieces.graphs[-1].capture_end()
            self.pool = pieces.graphs[-1].pool()
            pieces.attention.append((k_cache, v_cache, scale, options))
            begin()
            return self.attn_out[:count]

        with torch.cuda.stream(self.stream):
            begin()
            pieces.output = model(*args, meta(cut))
            pieces.graphs[-1].capture_end()
            self.pool = pieces.graphs[-1].pool()
        torch.cuda.synchronize()
        return pieces

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.token_counts[-1]

    def fits_whole(self, num_seqs: int, num_tokens: int) -> bool:
        """Whether a step of these sequences and tokens runs as one whole graph (run_whole)."""
        # (the whole graphs' counts are the ladder's up to the largest, so the next count up of a step that fits
        # has one)
        return num_seqs == 1 and bool(self.whole) and num_tokens <= max(self.whole)

    def _load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> tuple[int, int]:
        """Copy a step's tokens into the graphs' inputs, padded up to the next count of the ladder (padding: slot
        -1); its token count and that count."""
        n = input_ids.shape[0]
        count = next(t for t in self.token_counts if t >= n)
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = meta.slot_mapping
        self.slot_mapping[n:count] = -1
        return n, count

    def run_whole(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The hidden states of one sequence's step (fits_whole), through the whole graph of the next count up."""
        n, count = self._load(input_ids, positions, meta)
        graph, output = self.whole[count]
        self.cu_query_lens.copy_(meta.cu_query_lens)
        self.context_lens.copy_(meta.context_lens)
        self.block_tables[:, : meta.block_tables.shape[1]] = meta.block_tables  # (columns past it are never read)
        graph.replay()
        return output[:n]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The hidden states of a step of `num_tokens` tokens, through the pieces of the next count up."""
        n, count = self._load(input_ids, positions, meta)
        pieces = self.pieces[count]
        assert self.query is not None and self.attn_out is not None
        for graph, (k_cache, v_cache, scale, options) in zip(pieces.graphs, pieces.attention):
            graph.replay()
            ops.paged_attention(self.query[:n], k_cache, v_cache, meta, scale, out=self.attn_out[:n], **options)
        pieces.graphs[-1].replay()
        assert pieces.output is not None
        return pieces.output[:n]
