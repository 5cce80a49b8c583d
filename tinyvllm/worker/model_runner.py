"""The ModelRunner owns the model and its KV cache, turns a scheduled batch into tensors, runs the
forward pass, and samples the next token of every sequence that reached the end of its tokens."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from tinyvllm import ops
from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.distributed import TensorParallel
from tinyvllm.engine.scheduler import SchedulerOutput
from tinyvllm.engine.sequence import Sequence
from tinyvllm.ops import AttentionMetadata
from tinyvllm.worker.sampler import AsyncSamplerOutput, Sampler, SamplingTensors, step_seeds

logger = logging.getLogger(__name__)


@dataclass
class ModelInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the hidden states whose next token is sampled
    sampled_seqs: list[Sequence]
    sampling: SamplingTensors


class Staging:
    """A step's host arrays (any dtypes) packed into one buffer and copied to the device in one transfer
    (and, with tensor parallelism, broadcast to the other ranks as one tensor). On CUDA the buffer is
    pinned (allocating pinned memory per step costs more than the copy). There are two, used in turn:
    step N+1 is packed while step N's copy may still wait behind step N-1 in the stream (async
    scheduling), but N-1's copy is done, since N-1's tokens have been read back."""

    # Every array starts 16-byte aligned: Triton specializes a kernel on whether each pointer argument is
    # a multiple of 16, so arrays at varying 8-byte offsets would compile new variants mid-run (measured:
    # seconds lost in the first throughput-256 run).
    ALIGN = 16

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers = [torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)]
        self._turn = 0

    @classmethod
    def layout(cls, arrays: list[np.ndarray]) -> list[tuple[int, int, tuple[int, ...]]]:
        """(byte offset, dtype code, shape) of each array in the packed buffer."""
        result, offset = [], 0
        for a in arrays:
            result.append((offset, DTYPE_CODES[a.dtype], a.shape))
            offset += -(-a.nbytes // cls.ALIGN) * cls.ALIGN
        return result

    def upload(self, arrays: list[np.ndarray]) -> tuple[torch.Tensor, list[tuple[int, int, tuple[int, ...]]]]:
        """The packed device buffer and its layout (Staging.views turns them into tensors)."""
        layout = self.layout(arrays)
        total = layout[-1][0] + arrays[-1].nbytes if arrays else 0
        buffer = self._buffers[self._turn]
        if buffer.numel() < total:
            size = max(total, 2 * buffer.numel())
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
            self._buffers[self._turn] = buffer
        self._turn ^= 1
        host = buffer.numpy()
        for a, (offset, _, _) in zip(arrays, layout):
            host[offset:offset + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        if self.device.type != "cuda":  # the CPU runs the step from the buffer itself
            return buffer[:total], layout
        return buffer[:total].to(self.device, non_blocking=True), layout

    @staticmethod
    def views(buffer: torch.Tensor, layout: list[tuple[int, int, tuple[int, ...]]]) -> list[torch.Tensor]:
        views = []
        for offset, code, shape in layout:
            dtype = TORCH_DTYPES[code]
            nbytes = math.prod(shape) * dtype.itemsize  # (not np.prod: this runs 14 times a step)
            view = buffer[offset:offset + nbytes].view(dtype)
            views.append(view if len(shape) == 1 else view.view(shape))
        return views


DTYPE_CODES = {np.dtype(np.int64): 0, np.dtype(np.int32): 1, np.dtype(np.float32): 2}
TORCH_DTYPES = [torch.int64, torch.int32, torch.float32]

# With tensor parallelism rank 0 broadcasts each step as a fixed-size int64 header (what follows, the
# batch's two maxima and the layout) and then the packed buffer; the other ranks rebuild the step from them.
_HEADER_SIZE = 128
# What a row's SamplingParams ask of the sampler beyond the kernel (bits of ModelRunner._needs)
_PENALTIES, _LOGPROBS, _MIN_TOKENS = 1, 2, 4
_STEP, _STOP = 1, 2


class ModelRunner:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, config: EngineConfig,
                 device: torch.device, dtype: torch.dtype, max_model_len: int,
                 tp: TensorParallel = TensorParallel()) -> None:
        self.model = model
        self.tp = tp
        self.num_kv_heads = model.model.layers[0].self_attn.num_kv_heads  # this rank's share
        self.model_config = model_config
        self.config = config
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.max_blocks_per_seq = (max_model_len + self.block_size - 1) // self.block_size
        self.sampler = Sampler(model_config.vocab_size, device)
        self.num_blocks = self._decide_num_blocks()
        self._allocate_kv_cache(self.num_blocks)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._staging = Staging(device)
        self._init_rows(2 * config.max_num_seqs)
        # (The reference ops synchronize with the host, so they are not capturable; and graphs holding NCCL
        # collectives are not captured yet: tensor parallelism runs eager.)
        if device.type == "cuda" and not config.enforce_eager and ops.triton_available() and tp.size == 1:
            self.capture_cudagraphs()

    # ---- KV cache -------------------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        c = self.model_config
        return 2 * c.num_layers * self.block_size * self.num_kv_heads * c.head_dim * self.dtype.itemsize

    def _decide_num_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        enough = self.config.max_num_seqs * self.max_blocks_per_seq  # more is never used
        if self.device.type == "cuda":
            num_blocks = min(enough, self._profile_num_blocks())
        else:
            budget = int(self.config.cpu_kv_cache_gb * 2**30)
            num_blocks = max(1, min(enough, budget // self.bytes_per_block()))
        if self.tp.size > 1:  # every rank holds the same blocks (of its heads): the least any rank can hold
            count = torch.tensor([num_blocks], device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MIN, group=self.tp.group)
            num_blocks = int(count.item())
        return num_blocks

    @torch.inference_mode()
    def _profile_num_blocks(self) -> int:
        """Run the largest step the scheduler can produce, then give the KV cache whatever
        gpu_memory_utilization leaves after the weights and that step's peak activations."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = self.config.max_num_batched_tokens
        self._allocate_kv_cache(self.blocks_needed(num_tokens))
        seq_len = min(num_tokens, self.max_blocks_per_seq * self.block_size)
        num_seqs = (num_tokens + seq_len - 1) // seq_len
        lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
        blocks = torch.arange(self.blocks_needed(num_tokens), device=self.device, dtype=torch.int32)
        block_tables = torch.zeros(num_seqs, self.max_blocks_per_seq, dtype=torch.int32, device=self.device)
        start = 0
        for i, n in enumerate(lens):
            nb = self.blocks_needed(n)
            block_tables[i, :nb] = blocks[start // self.block_size:start // self.block_size + nb]
            start += nb * self.block_size
        cu = torch.tensor([0] + lens, device=self.device).cumsum(0).to(torch.int32)
        meta = AttentionMetadata(cu, torch.tensor(lens, dtype=torch.int32, device=self.device), block_tables,
                                 torch.arange(num_tokens, device=self.device), max(lens), max(lens))
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        hidden = self.model(ids, positions, meta)
        self.model.compute_logits(hidden[: min(num_tokens, self.config.max_num_seqs)])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device)
        self._free_kv_cache()
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        # Memory other processes (and the CUDA context) hold counts against us too.
        free_now, _ = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free_now - torch.cuda.memory_reserved(self.device)
        available = total * self.config.gpu_memory_utilization - peak - max(used_by_others, 0)
        num_blocks = int(available // self.bytes_per_block())
        if num_blocks < 1:
            raise ValueError(
                f"no GPU memory is left for the KV cache (peak {peak / 2**30:.1f} GiB of "
                f"{total / 2**30:.1f} GiB): raise gpu_memory_utilization or lower max_num_batched_tokens")
        logger.info("KV cache: %d blocks of %d tokens (%.1f GiB)", num_blocks, self.block_size,
                    num_blocks * self.bytes_per_block() / 2**30)
        return num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        c = self.model_config
        shape = (num_blocks, self.block_size, self.num_kv_heads, c.head_dim)
        for layer in self.model.model.layers:
            layer.self_attn.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.self_attn.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _free_kv_cache(self) -> None:
        for layer in self.model.model.layers:
            layer.self_attn.k_cache = layer.self_attn.v_cache = torch.empty(0)

    # ---- one step ---------------------------------------------------------------------------------
    # Each sequence in the batch holds a row of persistent host arrays: its block table (only blocks it
    # gained since the last step are written) and its sampling parameters (written once). A step gathers
    # the rows it needs with numpy, so its host cost is a few numpy calls plus one short loop for the
    # token ids, not a Python list of every block of every sequence.
    def _init_rows(self, capacity: int) -> None:
        self._rows: dict[int, int] = {}
        self._free_rows = list(range(capacity - 1, -1, -1))
        self._tables = np.zeros((capacity, self.max_blocks_per_seq), dtype=np.int32)
        self._synced = np.zeros(capacity, dtype=np.int64)  # block-table entries written per row
        self._temperature = np.zeros(capacity, dtype=np.float32)
        self._top_k = np.zeros(capacity, dtype=np.int64)
        self._top_p = np.ones(capacity, dtype=np.float32)
        self._min_p = np.zeros(capacity, dtype=np.float32)
        self._seeds = np.zeros(capacity, dtype=np.uint64)
        self._needs = np.zeros(capacity, dtype=np.int8)  # _PENALTIES | _LOGPROBS | _MIN_TOKENS

    def _grow_rows(self) -> None:
        old = self._tables.shape[0]
        for name in ("_tables", "_synced", "_temperature", "_top_k", "_top_p", "_min_p", "_seeds", "_needs"):
            array = getattr(self, name)
            grown = np.zeros((2 * old, *array.shape[1:]), dtype=array.dtype)
            grown[:old] = array
            setattr(self, name, grown)
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))

    def _row(self, seq: Sequence) -> int:
        row = self._rows.get(seq.seq_id)
        if row is None:
            if not self._free_rows:
                self._grow_rows()
            row = self._rows[seq.seq_id] = self._free_rows.pop()
            self._synced[row] = 0
            p = seq.params
            self._temperature[row] = 0.0 if p.greedy else p.temperature
            self._top_k[row], self._top_p[row], self._min_p[row] = p.top_k, p.top_p, p.min_p
            self._seeds[row] = seq.seed
            self._needs[row] = (_PENALTIES * p.has_penalties | _LOGPROBS * (p.logprobs is not None)
                                | _MIN_TOKENS * (p.min_tokens > 0))
        table, synced = seq.block_table, int(self._synced[row])
        if len(table) > synced:
            self._tables[row, synced:len(table)] = table[synced:]
            self._synced[row] = len(table)
        return row

    def prepare(self, batch: SchedulerOutput, prev: AsyncSamplerOutput | None = None) -> ModelInput:
        """The batch's tensors. A token that the previous step sampled and the host has not read yet
        (a placeholder, with async scheduling) is taken from that step's output on the device."""
        for seq_id in batch.released:
            row = self._rows.pop(seq_id, None)
            if row is not None:
                self._free_rows.append(row)
        seqs, bs = batch.seqs, self.block_size
        n = len(seqs)
        rows = np.fromiter((self._row(s) for s in seqs), dtype=np.int64, count=n)
        starts = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=n)
        num_new = np.array(batch.num_new_tokens, dtype=np.int64)
        ends = starts + num_new
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(num_new, out=cu[1:])
        total = int(cu[-1])
        if total == n:  # decode: one token per sequence
            positions, token_rows = starts, rows
        else:
            positions = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1] - starts, num_new)
            token_rows = np.repeat(rows, num_new)
        slots = self._tables[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        width = int((ends.max() + bs - 1) // bs)
        tables = self._tables[rows, :width]

        input_ids: list[int] = []
        pending_dst: list[int] = []
        pending_src: list[int] = []
        sampled: list[int] = []
        for i, seq in enumerate(seqs):
            start, end = int(starts[i]), int(ends[i])
            input_ids.extend(seq.token_ids[start:end])
            if seq.num_pending and end > seq.num_tokens - seq.num_pending:
                # Only the previous step's token can still be pending, and it is this step's last input.
                assert prev is not None and end == seq.num_tokens - seq.num_pending + 1, seq
                pending_dst.append(int(cu[i + 1]) - 1)
                pending_src.append(prev.row_of[seq.seq_id])
            if end == seq.num_tokens:  # the last token is in this step: sample the next
                sampled.append(i)
        sampled_seqs = [seqs[i] for i in sampled]
        sampled_np = np.array(sampled, dtype=np.int64)
        sample_rows = rows[sampled_np]
        temperature = self._temperature[sample_rows]
        greedy = temperature == 0
        all_greedy = bool(greedy.all())
        # The model's arrays first (the other ranks take those), then, only when the step needs them (each
        # costs host time on a slow CPU), the pending tokens' places and the sampling parameters.
        arrays = [np.array(input_ids, dtype=np.int64), positions, slots, cu[1:][sampled_np] - 1,
                  cu.astype(np.int32), ends.astype(np.int32), tables]
        if pending_dst:
            arrays += [np.array(pending_dst, dtype=np.int64), np.array(pending_src, dtype=np.int64)]
        if not all_greedy:
            steps = np.fromiter((s.num_output_tokens for s in sampled_seqs), dtype=np.int64, count=len(sampled))
            top_k = self._top_k[sample_rows]
            top_p, min_p = self._top_p[sample_rows], self._min_p[sample_rows]
            arrays += [temperature, top_k, top_p, min_p, step_seeds(self._seeds[sample_rows], steps)]
        buffer, layout = self._staging.upload(arrays)
        views = Staging.views(buffer, layout)
        ids_t, positions_t, slots_t, logits_t, cu_t, context_t, tables_t = views[:7]
        if pending_dst:
            dst_t, src_t = views[7:9]
            ids_t[dst_t] = prev.token_ids[src_t]
        max_query_len, max_context_len = int(num_new.max()), int(ends.max())
        if self.tp.size > 1:
            self._broadcast_step(buffer, layout, max_query_len, max_context_len)
        meta = AttentionMetadata(cu_query_lens=cu_t, context_lens=context_t, block_tables=tables_t,
                                 slot_mapping=slots_t, max_query_len=max_query_len, max_context_len=max_context_len)
        needs = int(np.bitwise_or.reduce(self._needs[sample_rows])) if len(sampled) else 0
        flags = dict(any_penalties=bool(needs & _PENALTIES), any_logprobs=bool(needs & _LOGPROBS),
                     any_min_tokens=bool(needs & _MIN_TOKENS))
        if all_greedy:
            sampling = SamplingTensors.greedy(**flags)
        else:
            active_k = ~greedy & (top_k > 0) & (top_k < self.model_config.vocab_size)
            sampling = SamplingTensors(*views[-5:], all_greedy=False, use_top_p=bool(((top_p < 1) & ~greedy).any()),
                                       max_top_k=int(top_k[active_k].max()) if active_k.any() else 0,
                                       use_min_p=bool(((min_p > 0) & ~greedy).any()), **flags)
        return ModelInput(ids_t, positions_t, meta, logits_t, sampled_seqs, sampling)

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput, prev: AsyncSamplerOutput | None = None) -> AsyncSamplerOutput:
        """Launches one step; its sampled tokens (for the sequences that get one) come back through the
        returned AsyncSamplerOutput. `prev`: the step before, whose tokens may still be pending."""
        inputs = self.prepare(batch, prev)
        num_seqs = len(batch.seqs)
        if inputs.meta.is_decode and self.graphs and num_seqs <= self.graph_batch_sizes[-1]:
            hidden = self._replay_graph(inputs, num_seqs)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        if not inputs.sampled_seqs:
            return AsyncSamplerOutput([], torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64),
                                      None, None, False)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        return self.sampler(logits, inputs.sampled_seqs, inputs.sampling)

    # ---- tensor parallelism: rank 0 sends each step, the other ranks run it ---------------------------
    def _broadcast_step(self, buffer: torch.Tensor, layout: list, max_query_len: int, max_context_len: int) -> None:
        fields = [_STEP, buffer.numel(), max_query_len, max_context_len, len(layout)]
        for offset, code, shape in layout:
            fields += [offset, code, len(shape), *shape, *[0] * (2 - len(shape))]
        header = torch.zeros(_HEADER_SIZE, dtype=torch.int64)
        header[: len(fields)] = torch.tensor(fields)
        dist.broadcast(header.to(self.device), src=0, group=self.tp.group)
        dist.broadcast(buffer, src=0, group=self.tp.group)

    def stop_workers(self) -> None:
        """Rank 0: tell the other ranks' serve_steps loops to return."""
        header = torch.zeros(_HEADER_SIZE, dtype=torch.int64, device=self.device)
        header[0] = _STOP
        dist.broadcast(header, src=0, group=self.tp.group)

    @torch.inference_mode()
    def serve_steps(self) -> None:
        """Ranks 1..N-1: run every step rank 0 broadcasts (the forward pass and this rank's share of the
        logits, whose collectives pair with rank 0's), until it says stop."""
        header = torch.empty(_HEADER_SIZE, dtype=torch.int64, device=self.device)
        while True:
            dist.broadcast(header, src=0, group=self.tp.group)
            fields = header.tolist()
            if fields[0] == _STOP:
                return
            total, max_query_len, max_context_len, num_arrays = fields[1:5]
            layout = []
            for i in range(num_arrays):
                offset, code, ndim, *shape = fields[5 + 5 * i:10 + 5 * i]
                layout.append((offset, code, tuple(shape[:ndim])))
            buffer = torch.empty(total, dtype=torch.uint8, device=self.device)
            dist.broadcast(buffer, src=0, group=self.tp.group)
            ids, positions, slots, logits_indices, cu, context, tables = Staging.views(buffer, layout)[:7]
            meta = AttentionMetadata(cu, context, tables, slots, max_query_len, max_context_len)
            hidden = self.model(ids, positions, meta)
            if logits_indices.numel():
                self.model.compute_logits(hidden[logits_indices])

    # ---- CUDA graphs for decode -----------------------------------------------------------------------
    # A decode step of a small model is tens of kernel launches per layer: on a slow host CPU, launching
    # them costs more than running them. Each batch size of a ladder gets a graph captured once, over
    # persistent input buffers; a step copies its inputs into the buffers (padding rows write nowhere:
    # slot -1, context 0) and replays the graph of the next size up.
    @torch.inference_mode()
    def capture_cudagraphs(self) -> None:
        max_bs = min(self.config.max_num_seqs, 512)
        self.graph_batch_sizes = [b for b in (1, 2, 4, 8) if b < max_bs] + list(range(16, max_bs, 16)) + [max_bs]
        self.graph_batch_sizes = sorted(set(self.graph_batch_sizes))
        device = self.device
        self.graph_buffers = dict(
            input_ids=torch.zeros(max_bs, dtype=torch.int64, device=device),
            positions=torch.zeros(max_bs, dtype=torch.int64, device=device),
            slot_mapping=torch.full((max_bs,), -1, dtype=torch.int64, device=device),
            context_lens=torch.zeros(max_bs, dtype=torch.int32, device=device),
            block_tables=torch.zeros(max_bs, self.max_blocks_per_seq, dtype=torch.int32, device=device),
            cu_query_lens=torch.arange(max_bs + 1, dtype=torch.int32, device=device),
        )
        b = self.graph_buffers
        self.graph_outputs = torch.zeros(max_bs, self.model_config.hidden_size, dtype=self.dtype, device=device)
        pool = None
        for bs in reversed(self.graph_batch_sizes):
            meta = AttentionMetadata(b["cu_query_lens"][: bs + 1], b["context_lens"][:bs], b["block_tables"][:bs],
                                     b["slot_mapping"][:bs], max_query_len=1,
                                     max_context_len=self.max_blocks_per_seq * self.block_size)
            args = (b["input_ids"][:bs], b["positions"][:bs], meta)
            self.graph_outputs[:bs] = self.model(*args)  # warm-up: compiles the kernels outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.graph_outputs[:bs] = self.model(*args)
            pool = graph.pool()
            self.graphs[bs] = graph
        for graph in self.graphs.values():
            graph.replay()  # the first replay uploads the graph to the device: pay for it now, not mid-run
        torch.cuda.synchronize()

    def _replay_graph(self, inputs: ModelInput, num_seqs: int) -> torch.Tensor:
        bs = next(b for b in self.graph_batch_sizes if b >= num_seqs)
        b = self.graph_buffers
        meta = inputs.meta
        b["input_ids"][:num_seqs] = inputs.input_ids
        b["positions"][:num_seqs] = inputs.positions
        b["slot_mapping"][:num_seqs] = meta.slot_mapping
        b["slot_mapping"][num_seqs:bs] = -1
        b["context_lens"][:num_seqs] = meta.context_lens
        b["context_lens"][num_seqs:bs] = 0
        b["block_tables"][:num_seqs, : meta.block_tables.shape[1]] = meta.block_tables
        self.graphs[bs].replay()
        return self.graph_outputs[:num_seqs]
