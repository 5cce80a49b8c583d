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
        weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn,
                                          device=layer.weight.device), requires_grad=False)
        weight.weight_loader, weight.shard_ids = layer.weight.weight_loader, layer.weight.shard_ids
        layer.weight = weight
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
                scale = torch.cat([scale[i].expand(rows) for i, (_, rows) in enumerate(_shard_rows(layer))])
        layer.weight = nn.Parameter(w8.contiguous(), requires_grad=False)
        layer.weight_scale = nn.Parameter(scale.float().contiguous(), requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.uses_decode_kernel(x):
            return ops.fused_linear(x, layer.weight, weight_scale=layer.weight_scale)
        return ops.fp8_linear(x, layer.weight, layer.weight_scale, bias)

    def add_to(self, layer: nn.Module, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return h.add_(ops.fp8_linear(x, layer.weight, layer.weight_scale))


def method_of(config: QuantizationConfig | None) -> UnquantizedLinearMethod | Fp8LinearMethod | None:
    """The method of the layers `config` quantizes (None: every layer keeps the default, unquantized)."""
    return None if config is None else Fp8LinearMethod(config)


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
