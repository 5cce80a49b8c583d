"""How a linear layer stores its weight and multiplies by it: the one place that knows a layer's weight format
(vLLM's LinearMethodBase). Every Linear (model/layers.py) has a `method`; the model files never see the format.

- UnquantizedLinearMethod: the weight in the model's dtype. After loading, a product that cuBLAS runs keeps its
  weight stored [in, out] (F.linear still sees [out, in], transposed): on the CPU MKL multiplies faster at decode
  batch sizes, and on the H200 cuBLAS picks kernels for it that are as fast or faster (benchmarks/profile_step.py).
  A product on our decode kernels keeps [out, in], the layout of their GEMV (ops.decode_kernel_on).
- Fp8LinearMethod: float8 e4m3 weights [out, in] with a float32 scale per output channel (w = w8 * scale[row]);
  each product quantizes its activations per token and runs on the fp8 tensor cores (ops.fp8_linear), or at decode
  sizes on our kernels, which read the float8 weights and apply the scales in their epilogue. On the CPU,
  ops.fp8_linear's reference dequantizes per product. The weights are quantized as they load (from a checkpoint of
  any float dtype, norms folded first), or come quantized from the checkpoint, with scales per channel or per
  tensor; a per-tensor scale becomes the scale of each of its rows, exactly.

- GGUFInt4LinearMethod (the CPU, a GGUF's 4-bit types Q4_0, Q4_1, Q4_K): the weight stays 4-bit, packed once at load
  for torch's CPU kernel (torch.ops.aten._weight_int4pack_mm_for_cpu) with a bfloat16 scale and zero per group of 32
  inputs; the activations go in as bfloat16, the kernel's fast path (it runs float32 activations through a scalar
  loop), and the product comes back in the activations' dtype.
- GGUFBf16LinearMethod (the CPU, a GGUF's other quantized types): the weight dequantized to bfloat16, half the bytes
  of float32, multiplied by oneDNN's bfloat16 kernels with the activations cast to bfloat16. Also a tied embedding
  table of those types (one copy serves the lookups and the LM head).

A method has three steps: create_weights (before loading: the parameters the checkpoint fills, with their
loaders), process_weights_after_loading (quantize, repack, lay out) and apply / add_to (the product)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from tinyvllm import ops
from tinyvllm.config import QuantizationConfig


class UnquantizedLinearMethod:
    """The weight as the model's dtype holds it."""

    can_fold_norms = True  # RMSNorm.fold_into may scale the weight's columns

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not (layer.product and ops.decode_kernel_on(layer.product, layer.weight.device)):
            layer.weight.data = layer.weight.data.t().contiguous().t()

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.uses_decode_kernel(x):
            return ops.fused_linear(x, layer.weight)
        return F.linear(x, layer.weight, bias)

    def add_to(self, layer: nn.Module, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """h += x W^T in place, the add inside cuBLAS (addmm, beta = 1): one rounding of the sum."""
        return h.addmm_(x, layer.weight.t())


UNQUANTIZED = UnquantizedLinearMethod()


class Fp8LinearMethod:
    """float8 e4m3 weights, a float32 scale per output channel (`layer.weight_scale`, [out])."""

    def __init__(self, config: QuantizationConfig) -> None:
        self.config = config
        # A float8 checkpoint's weights cannot take a norm's weight exactly: its norms stay unfolded.
        self.can_fold_norms = not config.from_checkpoint

    def create_weights(self, layer: nn.Module) -> None:
        """From a float8 checkpoint: a float8 weight to load into and its scale, per output channel (loaded as the
        bias is: cut by rows where the layer splits its outputs) or one per shard of a merged weight. Else the
        weight stays in the model's dtype until process_weights_after_loading quantizes it."""
        layer.method = self
        if not self.config.from_checkpoint:
            return
        out_features, in_features = layer.weight.shape
        layer.weight = weight = _loaded_like_weight(layer, (out_features, in_features), torch.float8_e4m3fn)
        if self.config.weight_strategy == "channel":
            shape, loader = (out_features,), _channel_scale_loader(layer)
        else:
            shape, loader = (len(layer.weight.shard_ids),), _tensor_scale_loader(layer)
        scale = nn.Parameter(torch.empty(shape, dtype=torch.float32, device=weight.device), requires_grad=False)
        scale.weight_loader, scale.shard_ids = loader, layer.weight.shard_ids
        layer.weight_scale = scale

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.config.from_checkpoint:
            w8, scale = ops.quantize_fp8_weight(layer.weight.data)
        else:
            w8, scale = layer.weight.data, layer.weight_scale.data
            if self.config.weight_strategy == "tensor":  # each shard's scale, repeated over its rows
                scale = torch.cat([ops.per_channel_scale(scale[i], rows)
                                   for i, (_, rows) in enumerate(_shard_rows(layer))])
        layer.weight = nn.Parameter(w8.contiguous(), requires_grad=False)
        layer.weight_scale = nn.Parameter(scale.float().contiguous(), requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.uses_decode_kernel(x):
            return ops.fused_linear(x, layer.weight, weight_scale=layer.weight_scale)
        return ops.fp8_linear(x, layer.weight, layer.weight_scale, bias)

    def add_to(self, layer: nn.Module, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return h.add_(ops.fp8_linear(x, layer.weight, layer.weight_scale))


INT4_GROUP = 32
# Per row of an LM head kept as a tied Q8_0 table: how many of its largest logits are recomputed in float32 from the
# table's exact rows (GGUFInt4LinearMethod.refine_top_logits).
REFINED_LOGITS = 32


class GGUFInt4LinearMethod:
    """A GGUF weight kept in its own bits on the CPU (gguf_loader.KEPT_TYPES), multiplied by torch's int4 kernel.

    bits=4 (Q4_0, Q4_1, Q4_K): before loading the layer holds what gguf_loader.int4_groups gives, filled shard by
    shard as a float weight is: `weight`, uint8 [out, in / 2] (the 4-bit values, two a byte), and `weight_scale`,
    float32 [out, in / 32, 2] ((scale, zero) of each group). bits=8 (Q8_0): gguf_loader.int8_groups, `weight` int8
    [out, in] and `weight_scale` float32 [out, in / 32]; each weight becomes two 4-bit values (q = 16 hi + lo), the
    `hi` halves and the `lo` halves two groups of inputs side by side: the product reads [x | x] (2 in inputs).
    After loading, `weight` is torch's packed int4 layout (which depends on the CPU's vector width: it is never
    written to disk) and `weight_scale` its bfloat16 scales and zeros [inputs / 32, out, 2]; w = (q - 8) * scale +
    zero, exactly the file's weights with their scales rounded to bfloat16. A norm folded into the layer
    (fold_norm) scales the activations as they are cast to bfloat16, in the same op (the whole norm, where the
    layer asks for it: normed). A tied Q8_0 embedding table also keeps its int8 rows (`table`, `table_scale`) for
    lookups, and for the head's largest logits, which it recomputes from them in float32 (refine_top_logits)."""

    can_fold_norms = True

    def __init__(self, bits: int = 4, lookups: bool = False) -> None:
        """lookups: the layer is a tied embedding table, whose rows are also looked up (Q8_0 only)."""
        self.bits, self.lookups = bits, lookups

    def create_weights(self, layer: nn.Module) -> None:
        layer.method = self
        out_features, in_features = layer.weight.shape
        layer.input_scale = None
        if self.bits == 4:
            shapes = ((out_features, in_features // 2), torch.uint8), ((out_features, in_features // INT4_GROUP, 2),
                                                                        torch.float32)
        else:
            shapes = ((out_features, in_features), torch.int8), ((out_features, in_features // INT4_GROUP),
                                                                  torch.float32)
        layer.weight, layer.weight_scale = (_loaded_like_weight(layer, shape, dtype) for shape, dtype in shapes)

    def fold_norm(self, layer: nn.Module, norm_weight: torch.Tensor) -> None:
        """RMSNorm.fold_into: the norm's weight becomes a factor of the activations (the 4-bit values cannot take it
        exactly)."""
        scale = norm_weight.to(torch.float32, copy=True)  # (the norm then sets its own weight to 1)
        layer.input_scale = scale if layer.input_scale is None else layer.input_scale * scale

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        values, scales = layer.weight.data, layer.weight_scale.data
        out_features = values.shape[0]
        if self.bits == 4:
            groups = values.view(out_features, -1, INT4_GROUP // 2)
            q = torch.cat([groups & 0x0F, groups >> 4], dim=-1).view(out_features, -1).to(torch.int32)
            scale_zero = scales
        else:
            if self.lookups:  # a tied table: its rows for lookups (Q8_0's scales are float16 in the file: exact)
                layer.table, layer.table_scale = values, scales.to(torch.float16)
            q = values.to(torch.int32)
            q = torch.cat([(q >> 4) + 8, q & 0x0F], dim=1)  # hi (arithmetic shift: the floor) + 8, lo
            zeros = torch.zeros_like(scales)
            scale_zero = torch.stack([torch.cat([16 * scales, scales], dim=1),
                                      torch.cat([zeros, 8 * scales], dim=1)], dim=-1)
        layer.weight = nn.Parameter(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), requires_grad=False)
        layer.weight_scale = nn.Parameter(scale_zero.transpose(0, 1).to(torch.bfloat16).contiguous(),
                                          requires_grad=False)

    def product(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x W^T in bfloat16, [*x.shape[:-1], out]."""
        rows = x.reshape(-1, x.shape[-1])
        if layer.input_scale is not None:
            rows = torch.mul(rows, layer.input_scale, out=torch.empty(rows.shape, dtype=torch.bfloat16))
        return self._kernel(layer, rows).view(*x.shape[:-1], -1)

    def _kernel(self, layer: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        """rows [T, in] (cast to bfloat16 here if they are not) times the 4-bit weight: [T, out] in bfloat16."""
        rows = rows.to(torch.bfloat16)
        if self.bits == 8:
            rows = rows.repeat(1, 2)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, layer.weight, INT4_GROUP, layer.weight_scale)

    def normed(self, layer: nn.Module, h: torch.Tensor, eps: float) -> tuple[torch.Tensor, None]:
        """Linear.normed: the whole norm before the product (its folded weight is input_scale, fold_norm), where
        folded into the op after it would cost that op's rows a float32 pass of their own. On this CPU each small op
        costs more than its arithmetic, and this way the layer makes fewer (benchmarks/RESULTS.md)."""
        rows = ops.rms_norm(h.reshape(-1, h.shape[-1]), layer.input_scale, eps)
        return self._kernel(layer, rows).view(*h.shape[:-1], -1).to(h.dtype), None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.product(layer, x).to(x.dtype)
        if self.lookups:  # a tied table's product is the LM head's
            self.refine_top_logits(layer, x, y)
        return y if bias is None else y.add_(bias)

    def refine_top_logits(self, layer: nn.Module, x: torch.Tensor, logits: torch.Tensor) -> None:
        """The kernel's outputs are bfloat16: 8 significant bits, 1/8 apart at logits of 16 to 32, as far apart as
        a model's close candidates often are, so that greedy picks and logprobs would follow the rounding. The
        REFINED_LOGITS largest of each row are recomputed IN PLACE in float32, from the table's exact rows and x as
        it is: the most likely tokens (greedy's pick, the head of what sampling draws from) and their logprobs are
        the float32 model's, up to the layers' own bfloat16 activations; the others keep the rounding. In chunks
        of rows, so that the float32 rows gathered stay a few MB when a prompt's logprobs score every row."""
        rows, flat = x.reshape(-1, x.shape[-1]).float(), logits.view(-1, logits.shape[-1])
        if layer.input_scale is not None:
            rows = rows * layer.input_scale
        count = min(REFINED_LOGITS, flat.shape[-1])
        for start in range(0, rows.shape[0], 64):
            chunk, out = rows[start:start + 64], flat[start:start + 64]
            top = out.topk(count, dim=-1).indices  # [T, count]
            weights = layer.table[top].to(torch.float32).view(*top.shape, -1, INT4_GROUP)
            weights = (weights * layer.table_scale[top].unsqueeze(-1)).flatten(-2)  # [T, count, in]: exact
            out.scatter_(1, top, torch.bmm(weights, chunk.unsqueeze(-1)).squeeze(-1).to(out.dtype))

    def add_to(self, layer: nn.Module, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return h.add_(self.product(layer, x))

    def lookup(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows of a tied Q8_0 table, dequantized exactly (float32 scale times int8), in the model's dtype."""
        rows = layer.table[input_ids].to(torch.float32).view(*input_ids.shape, -1, INT4_GROUP)
        rows = rows * layer.table_scale[input_ids].unsqueeze(-1)
        return rows.flatten(-2).to(layer.dtype)


class GGUFBf16LinearMethod:
    """A GGUF weight of a quantized type that is not 4-bit (Q8_0, Q5_*, Q6_K, ...), dequantized as it loads into a
    bfloat16 weight; each product casts its activations to bfloat16 and its result back. Serves a Linear and a tied
    embedding table (VocabParallelEmbedding: its lookups return rows in the model's dtype)."""

    can_fold_norms = True

    def create_weights(self, layer: nn.Module) -> None:
        layer.method = self
        layer.weight = _loaded_like_weight(layer, tuple(layer.weight.shape), torch.bfloat16)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def lookup(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        return ops.embedding(input_ids, layer.weight).to(layer.dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = F.linear(x.to(torch.bfloat16), layer.weight).to(x.dtype)
        return y if bias is None else y.add_(bias)

    def add_to(self, layer: nn.Module, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return h.add_(F.linear(x.to(torch.bfloat16), layer.weight))


def method_of(config: QuantizationConfig | None) -> UnquantizedLinearMethod | Fp8LinearMethod | None:
    """The method of the layers `config` quantizes (None: every layer keeps the default, unquantized)."""
    return None if config is None else Fp8LinearMethod(config)


def _loaded_like_weight(layer: nn.Module, shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    """An empty parameter of a format's own shape and dtype that the checkpoint fills as it would fill layer.weight
    (its loader, cutting this rank's rows, and its shard ids)."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device=layer.weight.device), requires_grad=False)
    param.weight_loader = getattr(layer.weight, "weight_loader", None)
    param.shard_ids = getattr(layer.weight, "shard_ids", (None,))
    return param


def _shard_rows(layer: nn.Module) -> list[tuple[int, int]]:
    """(first row, rows) of each shard of the layer's weight, in shard_ids' order (one shard: all its rows)."""
    rows = getattr(layer, "shard_rows", None)
    return [rows[shard] for shard in layer.weight.shard_ids] if rows else [(0, layer.weight.shape[0])]


def _channel_scale_loader(layer: nn.Module) -> Any:
    """A per-channel scale ([out] or [out, 1] in the checkpoint) loads as the layer's bias does."""

    def load(param: nn.Parameter, tensor: Any, shard_id: Any = None) -> None:
        tensor = tensor if isinstance(tensor, torch.Tensor) else tensor[:]
        layer.weight_loader(param, tensor.reshape(-1).float(), shard_id)

    return load


def _tensor_scale_loader(layer: nn.Module) -> Any:
    """A per-tensor scale (one number) of each shard, into its place."""
    shards = list(layer.weight.shard_ids)

    def load(param: nn.Parameter, tensor: Any, shard_id: Any = None) -> None:
        tensor = tensor if isinstance(tensor, torch.Tensor) else tensor[:]
        if tensor.numel() != 1:
            raise ValueError(f"is a per-tensor scale of {tensor.numel()} elements; the checkpoint's "
                             "quantization_config says one per tensor")
        param.data[shards.index(shard_id)] = tensor.reshape(()).float()

    return load
