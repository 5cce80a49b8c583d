"""The ModelRunner owns the model and its KV cache, turns a scheduled batch into tensors, runs the
forward pass, and samples the next token of every sequence that reached the end of its tokens."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tinyvllm import ops
from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.engine.scheduler import SchedulerOutput
from tinyvllm.engine.sequence import Sequence
from tinyvllm.ops import AttentionMetadata
from tinyvllm.worker.sampler import Sampler, SamplerOutput

logger = logging.getLogger(__name__)


@dataclass
class ModelInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the hidden states whose next token is sampled
    sampled_seqs: list[Sequence]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, config: EngineConfig,
                 device: torch.device, dtype: torch.dtype, max_model_len: int) -> None:
        self.model = model
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
        self._staging = torch.empty(0, dtype=torch.int64)
        self._staging_np = self._staging.numpy()
        if device.type == "cuda" and not config.enforce_eager and ops.triton_available():
            self.capture_cudagraphs()  # (the reference ops synchronize with the host: not capturable)

    # ---- KV cache -------------------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        c = self.model_config
        return 2 * c.num_layers * self.block_size * c.num_kv_heads * c.head_dim * self.dtype.itemsize

    def _decide_num_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        enough = self.config.max_num_seqs * self.max_blocks_per_seq  # more is never used
        if self.device.type == "cuda":
            return min(enough, self._profile_num_blocks())
        budget = int(self.config.cpu_kv_cache_gb * 2**30)
        return max(1, min(enough, budget // self.bytes_per_block()))

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
        shape = (num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        for layer in self.model.model.layers:
            layer.self_attn.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.self_attn.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _free_kv_cache(self) -> None:
        for layer in self.model.model.layers:
            layer.self_attn.k_cache = layer.self_attn.v_cache = torch.empty(0)

    # ---- one step ---------------------------------------------------------------------------------
    def prepare(self, batch: SchedulerOutput) -> ModelInput:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_query_lens = [0]
        context_lens: list[int] = []
        logits_indices: list[int] = []
        sampled: list[Sequence] = []
        bs = self.block_size
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            cu_query_lens.append(cu_query_lens[-1] + num_new)
            context_lens.append(end)
            if end == seq.num_tokens:  # the last known token is in this step: sample the next
                logits_indices.append(cu_query_lens[-1] - 1)
                sampled.append(seq)
        max_blocks = max(len(s.block_table) for s in batch.seqs)
        tables = [x for s in batch.seqs for x in s.block_table + [0] * (max_blocks - len(s.block_table))]
        parts = (input_ids, positions, slots, logits_indices, cu_query_lens, context_lens, tables)
        input_ids_t, positions_t, slots_t, logits_t, cu_t, context_t, tables_t = self._to_device(parts)
        meta = AttentionMetadata(
            cu_query_lens=cu_t, context_lens=context_t, block_tables=tables_t.view(len(batch.seqs), max_blocks),
            slot_mapping=slots_t, max_query_len=max(batch.num_new_tokens), max_context_len=max(context_lens))
        return ModelInput(input_ids_t, positions_t, meta, logits_t, sampled)

    def _to_device(self, parts: tuple[list[int], ...]) -> list[torch.Tensor]:
        """All of a step's index arrays in one host-to-device copy, through a pinned staging buffer that
        lives as long as the runner (allocating pinned memory per step costs more than the copy). The
        step's sampled tokens are read back before the next step writes the buffer, so reuse is safe."""
        sizes = [len(p) for p in parts]
        total = sum(sizes)
        if self.device.type != "cuda":
            return list(torch.tensor([x for p in parts for x in p], dtype=torch.int64).split(sizes))
        if self._staging.numel() < total:
            self._staging = torch.empty(max(total, 2 * self._staging.numel()), dtype=torch.int64, pin_memory=True)
            self._staging_np = self._staging.numpy()
        offset = 0
        for part, size in zip(parts, sizes):
            self._staging_np[offset:offset + size] = part
            offset += size
        return list(self._staging[:total].to(self.device, non_blocking=True).split(sizes))

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> SamplerOutput:
        """Runs one step; returns the sampled token (and logprobs) of each sequence that gets one."""
        inputs = self.prepare(batch)
        num_seqs = len(batch.seqs)
        if inputs.meta.is_decode and self.graphs and num_seqs <= self.graph_batch_sizes[-1]:
            hidden = self._replay_graph(inputs, num_seqs)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        if not inputs.sampled_seqs:
            return SamplerOutput([], [], [])
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        return self.sampler(logits, inputs.sampled_seqs)

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
