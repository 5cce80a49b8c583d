"""The KV cache is the runner's: how many blocks the pool gets (an explicit num_kv_blocks, else what memory allows),
and each of the model's attention layers' pools (CausalLM.attention_layers), allocated here.

kv_cache_memory, when given, is the cache's size. Otherwise, on CUDA, the largest step the scheduler can
produce is run once to measure its peak activations, and the cache gets whatever gpu_memory_utilization
leaves after the weights and that peak; on the CPU, what the model and max_num_seqs need (cpu_default_blocks:
one sequence of the whole context, or one step's tokens, plus a block for each other sequence), within a tenth of
the memory available now; the CPU's pools are zero pages the OS backs as they are first written (ops.kv_pool), so
memory grows with the tokens cached, not with the pool. Never more than max_num_seqs sequences of max_model_len
tokens can use. Blocks are sized in the cache's dtype (cache_dtype: the
model's, or float8 e4m3 for kv_cache_dtype="fp8"), so a float8 cache gets twice the blocks of a bf16 one."""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from tinyvllm.config import EngineConfig
from tinyvllm.distributed import TensorParallel
from tinyvllm.model.interface import CausalLM
from tinyvllm.ops import AttentionMetadata
from tinyvllm.worker.prompt_logprobs import score_chunk_rows

logger = logging.getLogger(__name__)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


def kv_cache_bytes_per_block(model: CausalLM, block_size: int, cache_dtype: torch.dtype) -> int:
    """K and V of every attention layer for one block of tokens, on this rank (its share of the KV heads), in the
    cache's dtype (float8 e4m3 for kv_cache_dtype="fp8": a byte an element)."""
    return sum(layer.bytes_per_block(block_size, cache_dtype) for layer in model.attention_layers())


def allocate_kv_cache(model: CausalLM, num_blocks: int, block_size: int, cache_dtype: torch.dtype,
                      device: torch.device) -> None:
    """Give every attention layer its K and V pools of num_blocks blocks (0: drop them, to measure memory without
    them), in `cache_dtype` (the model's, or float8 e4m3: the ops convert on store and load)."""
    for layer in model.attention_layers():
        layer.allocate(num_blocks, block_size, cache_dtype, device)


def decide_num_blocks(model: CausalLM, config: EngineConfig, device: torch.device, cache_dtype: torch.dtype,
                      max_blocks_per_seq: int, tp: TensorParallel, extra_bytes_per_block: int = 0) -> int:
    """extra_bytes_per_block: of another cache with as many blocks, sized with this one (a draft model's)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    bytes_per_block = kv_cache_bytes_per_block(model, config.block_size, cache_dtype) + extra_bytes_per_block
    enough = config.max_num_seqs * max_blocks_per_seq  # more is never used
    budget = config.kv_cache_memory_bytes()
    if budget is not None:
        num_blocks = min(enough, budget // bytes_per_block)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory={config.kv_cache_memory} holds no block of {bytes_per_block} bytes")
    elif device.type == "cuda":
        num_blocks = min(enough, _profile_num_blocks(model, config, device, cache_dtype, max_blocks_per_seq,
                                                     extra_bytes_per_block))
    else:
        need = cpu_default_blocks(config.max_num_seqs, max_blocks_per_seq, config.block_size,
                                  config.max_num_batched_tokens)
        num_blocks = max(1, min(enough, need, _available_memory() // 10 // bytes_per_block))
    if tp.size > 1:  # every rank holds the same blocks (of its heads): the least any rank can hold
        count = torch.tensor([num_blocks], device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MIN, group=tp.group)
        num_blocks = int(count.item())
    return num_blocks


def cpu_default_blocks(max_num_seqs: int, max_blocks_per_seq: int, block_size: int,
                       max_num_batched_tokens: int) -> int:
    """The CPU's default pool: room for one sequence of the whole context (max_model_len, so that any request the
    engine takes fits alone) or for one step's tokens if that is more, plus one block for each other sequence a step
    may run (the block its next token goes to). Beyond that, sequences wait or are preempted and recomputed, which
    costs time; on a CPU each of many long sequences already does."""
    return max(max_blocks_per_seq, blocks_needed(max_num_batched_tokens, block_size)) + max_num_seqs - 1


def _available_memory() -> int:
    """Bytes of memory the OS says are available now (free plus reclaimable caches)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@torch.inference_mode()
def _profile_num_blocks(model: CausalLM, config: EngineConfig, device: torch.device, cache_dtype: torch.dtype,
                        max_blocks_per_seq: int, extra_bytes_per_block: int = 0) -> int:
    bs = config.block_size
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    num_tokens = config.max_num_batched_tokens
    allocate_kv_cache(model, blocks_needed(num_tokens, bs), bs, cache_dtype, device)  # (the step's own kernels run)
    seq_len = min(num_tokens, max_blocks_per_seq * bs)
    num_seqs = (num_tokens + seq_len - 1) // seq_len
    lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
    blocks = torch.arange(blocks_needed(num_tokens, bs), device=device, dtype=torch.int32)
    block_tables = torch.zeros(num_seqs, max_blocks_per_seq, dtype=torch.int32, device=device)
    start = 0
    for i, n in enumerate(lens):
        nb = blocks_needed(n, bs)
        block_tables[i, :nb] = blocks[start // bs:start // bs + nb]
        start += nb * bs
    cu = torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(cu, torch.tensor(lens, dtype=torch.int32, device=device), block_tables,
                             torch.arange(num_tokens, device=device), max(lens), max(lens))
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    hidden = model(ids, positions, meta)
    # The logits of the step's sampled rows, or of a chunk of prompt rows scored for their logprobs if more
    model.compute_logits(hidden[: min(num_tokens, max(config.max_num_seqs,
                                                       score_chunk_rows(model.config.vocab_size, device)))])
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(device)
    allocate_kv_cache(model, 0, bs, cache_dtype, device)
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    # Memory other processes (and the CUDA context) hold counts against us too.
    free_now, _ = torch.cuda.mem_get_info(device)
    used_by_others = total - free_now - torch.cuda.memory_reserved(device)
    available = total * config.gpu_memory_utilization - peak - max(used_by_others, 0)
    bytes_per_block = kv_cache_bytes_per_block(model, bs, cache_dtype) + extra_bytes_per_block
    num_blocks = int(available // bytes_per_block)
    if num_blocks < 1:
        raise ValueError(
            f"no GPU memory is left for the KV cache (peak {peak / 2**30:.1f} GiB of "
            f"{total / 2**30:.1f} GiB): raise gpu_memory_utilization or lower max_num_batched_tokens")
    logger.info("KV cache: %d blocks of %d tokens (%.1f GiB)", num_blocks, bs, num_blocks * bytes_per_block / 2**30)
    return num_blocks
