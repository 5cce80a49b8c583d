"""Tensor parallelism: which shard a process holds, the process group, and the two collectives the model
needs (an all-reduce after row-parallel layers, a gather of the vocabulary-split logits onto rank 0).

The parallel context is passed explicitly to the model; the size-1 default never touches torch.distributed."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    """This process's place among `size` ranks that each hold 1/size of every split weight.
    `group` is a torch.distributed ProcessGroup; None means the default (world) group."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def split(self, n: int) -> int:
        """This rank's share of a dimension that splits evenly (the config was checked beforehand)."""
        assert n % self.size == 0, f"{n} does not split over {self.size} ranks"
        return n // self.size


# TINYVLLM_TP_ONE_GPU=1 puts every rank on GPU 0 and talks gloo: a check of the tensor-parallel code on CUDA
# (tests/gpu/test_tensor_parallel_cuda.py) where only one GPU is at hand. NCCL needs a GPU per rank.
ONE_GPU = os.environ.get("TINYVLLM_TP_ONE_GPU", "0") == "1"


def rank_device(rank: int, device: torch.device) -> torch.device:
    """The device of rank `rank`: GPU r on CUDA (GPU 0 for all with TINYVLLM_TP_ONE_GPU=1), else the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", 0 if ONE_GPU else rank)


def init_tensor_parallel(rank: int, size: int, init_method: str, device: torch.device,
                         timeout_s: float = 600.0) -> TensorParallel:
    """Join the process group of `size` ranks (NCCL on CUDA, gloo on the CPU). On CUDA, rank r uses GPU r.
    init_method: "tcp://127.0.0.1:PORT" or "file:///path" (a path that does not exist yet)."""
    if device.type == "cuda":
        torch.cuda.set_device(rank_device(rank, device))
    backend = "nccl" if device.type == "cuda" and not ONE_GPU else "gloo"
    dist.init_process_group(backend, init_method=init_method, world_size=size, rank=rank,
                            timeout=timedelta(seconds=timeout_s))
    return TensorParallel(rank, size)


def destroy_tensor_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Sum of x over the ranks, in place: joins the partial products of a row-parallel layer."""
    dist.all_reduce(x, group=tp.group)
    return x


def gather_last_dim(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor | None:
    """The ranks' x concatenated along the last dimension, on rank 0 only (None elsewhere): only rank 0
    samples, so the full logits need not travel to every rank."""
    x = x.contiguous()
    if x.is_cuda and dist.get_backend(tp.group) == "gloo":  # gloo gathers CPU tensors only
        parts = [torch.empty_like(x) for _ in range(tp.size)]
        dist.all_gather(parts, x, group=tp.group)
        return torch.cat(parts, dim=-1) if tp.rank == 0 else None
    parts = [torch.empty_like(x) for _ in range(tp.size)] if tp.rank == 0 else None
    dst = 0 if tp.group is None else dist.get_global_rank(tp.group, 0)
    dist.gather(x, parts, dst=dst, group=tp.group)
    return torch.cat(parts, dim=-1) if parts is not None else None
