"""CUDA graphs for decode steps.

A decode step of a small model is tens of kernel launches per layer: on a slow host CPU, launching them
costs more than running them. Each batch size of a ladder gets a graph captured once, over persistent
input buffers; a step copies its inputs into the buffers (padding rows write nowhere: slot -1, context 0)
and replays the graph of the next size up."""

from __future__ import annotations

import torch

from tinyvllm.ops import AttentionMetadata


class CudaGraphs:
    @torch.inference_mode()
    def __init__(self, model: torch.nn.Module, max_num_seqs: int, max_blocks_per_seq: int, block_size: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        max_bs = min(max_num_seqs, 512)
        sizes = [b for b in (1, 2, 4, 8) if b < max_bs] + list(range(16, max_bs, 16)) + [max_bs]
        self.batch_sizes = sorted(set(sizes))
        self.buffers = dict(
            input_ids=torch.zeros(max_bs, dtype=torch.int64, device=device),
            positions=torch.zeros(max_bs, dtype=torch.int64, device=device),
            slot_mapping=torch.full((max_bs,), -1, dtype=torch.int64, device=device),
            context_lens=torch.zeros(max_bs, dtype=torch.int32, device=device),
            block_tables=torch.zeros(max_bs, max_blocks_per_seq, dtype=torch.int32, device=device),
            cu_query_lens=torch.arange(max_bs + 1, dtype=torch.int32, device=device),
        )
        b = self.buffers
        self.outputs = torch.zeros(max_bs, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = None
        for bs in reversed(self.batch_sizes):
            meta = AttentionMetadata(b["cu_query_lens"][: bs + 1], b["context_lens"][:bs], b["block_tables"][:bs],
                                     b["slot_mapping"][:bs], max_query_len=1,
                                     max_context_len=max_blocks_per_seq * block_size)
            args = (b["input_ids"][:bs], b["positions"][:bs], meta)
            self.outputs[:bs] = model(*args)  # warm-up: compiles the kernels outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[:bs] = model(*args)
            pool = graph.pool()
            self.graphs[bs] = graph
        for graph in self.graphs.values():
            graph.replay()  # the first replay uploads the graph to the device: pay for it now, not mid-run
        torch.cuda.synchronize()

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.batch_sizes[-1]

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The hidden states of a decode step (one token per sequence) through the graph of its size."""
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
        self.graphs[bs].replay()
        return self.outputs[:num_seqs]
