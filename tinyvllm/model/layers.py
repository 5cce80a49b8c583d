"""The layers every model family shares: linear layers (plain, and split over tensor-parallel ranks, Megatron-style,
as vLLM's), the vocabulary's embedding and LM head, RMSNorm, the rotary embedding's table and paged attention.

Every op but the matrix products goes through `tinyvllm.ops` (Triton on CUDA, PyTorch on the CPU). At decode sizes
on CUDA a product may run on our own kernel instead of cuBLAS (ops.use_decode_kernel, by the `product` name it
gets here), with the norm before it inside (RMSNorm.project).

Each parameter loads itself: its `weight_loader(param, tensor, shard_id)` takes a checkpoint tensor (or a lazy
safetensors slice, of which it reads only this rank's part) and writes it where it belongs, cut for this rank and,
in a merged weight (QKVParallelLinear, MergedColumnParallelLinear), into its shard's rows. `shard_ids` says which
shards make the parameter whole (None: the tensor itself). So the loader (model/loader.py) names no projection:
a family's model file maps checkpoint names onto merged parameters (`packed_modules_mapping`) and nothing more.
With the default TensorParallel() (size 1) the shapes are those of the plain model."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn as nn

from tinyvllm import ops
from tinyvllm.distributed import TensorParallel, all_reduce
from tinyvllm.model.quantization import UNQUANTIZED
from tinyvllm.ops import AttentionMetadata


class WeightLoadError(ValueError):
    """A checkpoint tensor that does not fit its parameter (the loader names the tensor)."""


def _materialize(tensor: Any) -> torch.Tensor:
    """A checkpoint tensor as a torch tensor: numpy arrays (GGUF) wrapped, lazy safetensors slices read whole."""
    if isinstance(tensor, np.ndarray):
        return torch.from_numpy(tensor)
    return tensor if isinstance(tensor, torch.Tensor) else tensor[:]


def _shape(tensor: Any) -> list[int]:
    return list(tensor.get_shape() if hasattr(tensor, "get_shape") else tensor.shape)


def copy_checked(dst: torch.Tensor, tensor: Any) -> None:
    """dst <- tensor, if their shapes agree."""
    src = _materialize(tensor)
    if tuple(src.shape) != tuple(dst.shape):
        raise WeightLoadError(f"has shape {tuple(src.shape)}, the config needs {tuple(dst.shape)}")
    dst.copy_(src)


def default_weight_loader(param: nn.Parameter, tensor: Any, shard_id: Any = None) -> None:
    """A parameter held whole on every rank."""
    copy_checked(param.data, tensor)


def load_rank_shard(dst: torch.Tensor, tensor: Any, dim: int, tp: TensorParallel, padded: bool = False) -> None:
    """dst <- this rank's part of `tensor` along `dim` (read from the file only now for a lazy slice). dst holds
    n = whole / ranks entries along `dim`; a padded tensor (the vocabulary) may end inside the last ranks' parts,
    whose tail is zeroed."""
    if tp.size == 1:
        copy_checked(dst, tensor)
        return
    shape, n = _shape(tensor), dst.shape[dim]
    if len(shape) != dst.dim() or not (shape[dim] == n * tp.size or (padded and -(-shape[dim] // tp.size) == n)):
        raise WeightLoadError(f"has shape {tuple(shape)}, which does not split into the config's {tp.size} ranks of "
                              f"{n} along dimension {dim}")
    start = min(tp.rank * n, shape[dim])
    length = min(n, shape[dim] - start)
    dst.narrow(dim, length, n - length).zero_()
    copy_checked(dst.narrow(dim, 0, length), tensor[(slice(None),) * dim + (slice(start, start + length),)])


def _parameter(*shape: int, loader: Any, shard_ids: tuple = (None,)) -> nn.Parameter:
    """An uninitialized parameter (the checkpoint fills it) that knows how to load itself."""
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader, param.shard_ids = loader, shard_ids
    return param


# ---- linear layers ----------------------------------------------------------------------------------------
class Linear(nn.Module):
    """y = x W^T (+ b), whole on every rank, through cuBLAS or, at decode sizes, our kernel (ops.fused_linear).
    `product` names the layer in ops.DECODE_KERNEL_MAX_ROWS; None (a bias, or a weight split over ranks) keeps it
    on cuBLAS. How the weight is stored and multiplied is its `method`'s (model/quantization.py): the model's dtype
    by default, or float8 with a scale per output channel (`weight_scale`). The weight loader takes any tensor
    indexed by output rows and its bias (a per-channel scale too)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, product: str | None = None,
                 shard_ids: tuple = (None,)) -> None:
        super().__init__()
        self.weight = _parameter(out_features, in_features, loader=self.weight_loader, shard_ids=shard_ids)
        self.bias = _parameter(out_features, loader=self.weight_loader, shard_ids=shard_ids) if bias else None
        self.weight_scale: torch.Tensor | None = None
        self.product = None if bias else product
        self.method = UNQUANTIZED

    def weight_loader(self, param: nn.Parameter, tensor: Any, shard_id: Any = None) -> None:
        default_weight_loader(param, tensor)

    def uses_decode_kernel(self, x: torch.Tensor) -> bool:
        return self.product is not None and ops.use_decode_kernel(self.product, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)

    def add_to(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """h += x W^T, in place (the residual stream of a layer with its norms folded)."""
        return self.method.add_to(self, h, x)

    def normed(self, h: torch.Tensor, eps: float) -> tuple[torch.Tensor, ops.RowNorm | None]:
        """(the product of RMSNorm(h) whose weight is folded into this layer; the ops.RowNorm that the op after it
        must still apply, or None where the product applied the norm). Most formats multiply h itself and leave
        each row's 1/rms to the op after, which on the GPU takes it inside its kernel; a format may normalize h
        first (model/quantization.py)."""
        normed = getattr(self.method, "normed", None)
        return (self(h), ops.RowNorm(h, eps)) if normed is None else normed(self, h, eps)


class ColumnParallelLinear(Linear):
    """Each rank holds a slice of the output features and computes that slice of y: no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel,
                 product: str | None = None, shard_ids: tuple = (None,)) -> None:
        super().__init__(in_features, tp.split(out_features), bias, product if tp.size == 1 else None, shard_ids)
        self.tp = tp

    def weight_loader(self, param: nn.Parameter, tensor: Any, shard_id: Any = None) -> None:
        load_rank_shard(param.data, tensor, 0, self.tp)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel products of one input in one weight (gate and up): the rows of shard shard_ids[i]
    (0, 1, ... by default) are output_sizes[i] (split over the ranks), one shard after the other."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, tp: TensorParallel,
                 product: str | None = None, shard_ids: tuple | None = None) -> None:
        shard_ids = tuple(range(len(output_sizes))) if shard_ids is None else shard_ids
        super().__init__(in_features, sum(output_sizes), bias, tp, product, shard_ids)
        sizes = [tp.split(size) for size in output_sizes]
        self.shard_rows = {shard: (sum(sizes[:i]), sizes[i]) for i, shard in enumerate(shard_ids)}  # (start, size)

    def weight_loader(self, param: nn.Parameter, tensor: Any, shard_id: Any = None) -> None:
        if shard_id not in self.shard_rows:
            raise WeightLoadError(f"is shard {shard_id!r} of a merged weight whose shards are {list(self.shard_rows)}")
        start, size = self.shard_rows[shard_id]
        load_rank_shard(param.data.narrow(0, start, size), tensor, 0, self.tp)


class QKVParallelLinear(MergedColumnParallelLinear):
    """Q, K and V in one weight, shards "q", "k" and "v": each rank holds its share of the query heads and of the KV
    heads they share."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 tp: TensorParallel, product: str | None = "qkv") -> None:
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], bias,
                         tp, product, ("q", "k", "v"))


class RowParallelLinear(Linear):
    """Each rank holds a slice of the input features (matching the column-parallel layer before it); the partial
    products are summed over the ranks. Only rank 0 adds the bias, so the sum has it once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel,
                 product: str | None = None) -> None:
        super().__init__(tp.split(in_features), out_features, bias, product if tp.size == 1 else None)
        self.tp = tp

    def weight_loader(self, param: nn.Parameter, tensor: Any, shard_id: Any = None) -> None:
        if param.dim() == 1:  # the bias, or a per-channel scale: indexed by the output, which is whole
            default_weight_loader(param, tensor)
        else:
            load_rank_shard(param.data, tensor, 1, self.tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        return all_reduce(self.method.apply(self, x, self.bias if self.tp.rank == 0 else None), self.tp)


# ---- the vocabulary ---------------------------------------------------------------------------------------
def vocab_rows_per_rank(vocab_size: int, tp: TensorParallel) -> int:
    """The vocabulary padded to a multiple of the ranks, split evenly: rank r holds ids [r * n, (r + 1) * n)."""
    return -(-vocab_size // tp.size)


class VocabParallelEmbedding(nn.Module):
    """Each rank looks up the tokens of its vocabulary range and zeroes the others; the all-reduce then holds every
    token's embedding."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.num_rows = vocab_rows_per_rank(num_embeddings, tp)
        self.weight = _parameter(self.num_rows, embedding_dim, loader=self.weight_loader)
        # The model's dtype. A tied table may be stored in another format (model/quantization.py: its method then
        # runs the lookups, in this dtype, and the LM head's product).
        self.dtype = self.weight.dtype
        self.method = UNQUANTIZED

    def weight_loader(self, param: nn.Parameter, tensor: Any, shard_id: Any = None) -> None:
        load_rank_shard(param.data, tensor, 0, self.tp, padded=True)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.method is not UNQUANTIZED:  # a table of another format (one rank: the CPU's GGUF loads)
            return self.method.lookup(self, input_ids)
        if self.tp.size == 1:
            return ops.embedding(input_ids, self.weight)
        local_ids = input_ids - self.tp.rank * self.num_rows
        outside = (local_ids < 0) | (local_ids >= self.num_rows)
        x = ops.embedding(local_ids.masked_fill(outside, 0), self.weight)
        return all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0), self.tp)


class ParallelLMHead(Linear):
    """The output projection, split over the vocabulary as VocabParallelEmbedding is (so a tied head is the
    embedding's own shard); CausalLM.compute_logits gathers the slices."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__(hidden_size, vocab_rows_per_rank(vocab_size, tp), bias=False)
        self.tp = tp

    def weight_loader(self, param: nn.Parameter, tensor: Any, shard_id: Any = None) -> None:
        load_rank_shard(param.data, tensor, 0, self.tp, padded=True)


# ---- normalization ----------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = _parameter(hidden_size, loader=default_weight_loader)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, residual stream): the residual add is fused into the norm."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps), x
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)

    def project(self, x: torch.Tensor, residual: torch.Tensor | None, linear: Linear, silu_and_mul: bool = False,
                rope: ops.RopeStore | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(linear(norm(x + residual)), residual stream), with silu_and_mul the MLP's gate applied to the product,
        with rope (a qkv product) q rotated in it and k, v stored in the cache: one kernel where the decode kernel
        applies to `linear`, else the norm, the product and the gate or the rotary op in turn."""
        if linear.uses_decode_kernel(x):
            return ops.fused_norm_linear(x, residual, self.weight, self.eps, linear.weight, silu_and_mul, rope=rope,
                                         weight_scale=linear.weight_scale)
        normed, residual = self(x, residual)
        y = linear(normed)
        if silu_and_mul:
            y = ops.silu_and_mul(y)
        if rope is not None:
            y = ops.rope_store(y, rope)
        return y, residual

    def fold_into(self, linear: Linear) -> None:
        """Fold the norm's weight into the product after it: W[:, k] *= g[k] (rounded once, from float32), and g = 1.
        Exact in exact arithmetic where the norm's output feeds only that product. In slices of rows, so that the
        float32 copy stays small. Before the weights take their format (a quantized one is made from the folded
        weight); a format that comes quantized from the checkpoint cannot take it (linear.method.can_fold_norms)."""
        assert linear.method.can_fold_norms, "this weight format cannot take a norm's weight"
        fold_norm = getattr(linear.method, "fold_norm", None)
        if fold_norm is not None:  # a format that keeps the norm's weight beside it (GGUFInt4LinearMethod)
            fold_norm(linear, self.weight.data)
            self.weight.data.fill_(1.0)
            return
        g = self.weight.data.float()[None, :]
        for rows in linear.weight.data.split(1024):
            rows.copy_(rows.float() * g)
        self.weight.data.fill_(1.0)


# ---- attention --------------------------------------------------------------------------------------------
class RotaryEmbedding(nn.Module):
    """The cos/sin table of the rotary embedding at every position (float32 whatever the model's dtype), with the
    config's frequency scaling (ops.rotary's ROPE_SCALING_TYPES). Built once the model is on its device."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.cos_sin_cache = torch.empty(0)

    def build(self, device: torch.device) -> None:
        self.cos_sin_cache = ops.build_cos_sin_cache(self.head_dim, self.max_positions, self.theta, self.scaling,
                                                     device)


class Attention(nn.Module):
    """Paged attention over this layer's KV cache. The model runner finds these modules (CausalLM.attention_layers),
    sizes the KV cache from them and gives each its pools: k_cache and v_cache, [num_blocks, block_size,
    num_kv_heads, head_dim] as the ops index them (ops.kv_pool), in the model's dtype or float8 e4m3.
    sliding_window: each token sees only the last sliding_window positions, itself included (Mistral, Gemma 2's
    local layers); logit_softcap: the scores are capped to cap * tanh(score / cap) before the softmax (Gemma 2)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, logit_softcap: float | None = None) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens or None, got {sliding_window}")
        if logit_softcap is not None and not logit_softcap > 0:
            raise ValueError(f"logit_softcap must be positive or None, got {logit_softcap}")
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.sliding_window, self.logit_softcap = sliding_window, logit_softcap
        self.q_size = num_heads * head_dim
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention [T, q_size] of the tokens whose q (rotated) leads `qkv`, their k and v already in the cache
        (rope_store stored them)."""
        num_tokens = qkv.shape[0]
        q = qkv[:, :self.q_size].view(num_tokens, self.num_heads, self.head_dim)
        out = (meta.attention or ops.paged_attention)(q, self.k_cache, self.v_cache, meta, self.scale,
                                                      **self.attention_options)
        return out.reshape(num_tokens, self.q_size)

    @property
    def attention_options(self) -> dict[str, Any]:
        """The keywords of ops.paged_attention this layer sets: only those, so that an `attention` hook of the plain
        signature (q, k_cache, v_cache, meta, scale) still serves the layers that set none."""
        options = {"sliding_window": self.sliding_window, "logit_softcap": self.logit_softcap}
        return {name: value for name, value in options.items() if value is not None}

    def rope_store(self, positions: torch.Tensor, cos_sin: torch.Tensor, meta: AttentionMetadata) -> ops.RopeStore:
        """What follows the qkv product: q and k rotated at `positions`, k and v stored at the step's cache slots."""
        return ops.RopeStore(positions, cos_sin, self.k_cache, self.v_cache, meta.slot_mapping, self.num_heads,
                             self.num_kv_heads, meta.memo)

    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        """This layer's K and V pools (num_blocks=0: none, to measure memory without them)."""
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        self.k_cache = ops.kv_pool(*shape, dtype, device) if num_blocks else torch.empty(0)
        self.v_cache = ops.kv_pool(*shape, dtype, device) if num_blocks else torch.empty(0)

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return 2 * block_size * self.num_kv_heads * self.head_dim * dtype.itemsize
