"""Configuration: what the model is (ModelConfig) and how the engine runs it (EngineConfig)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch


class ConfigError(ValueError):
    """A model or engine setting that we cannot run, with a message that says why."""


# Architecture names (config.json's `architectures`, GGUF's `general.architecture`) of the Llama family, which
# share one implementation -> its canonical name. The table lives here, not in model/registry (canonical name ->
# class), so that reading a config never imports a model: the models import this module.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "LlamaForCausalLM",
    "llama": "LlamaForCausalLM",
}


class UnsupportedArchitectureError(ConfigError):
    """A model of an architecture tinyvllm has no implementation for."""


def check_architecture(name: str) -> str:
    """The canonical architecture name, or an error that lists the ones we support."""
    if name not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"architecture {name!r} is not supported; tinyvllm runs: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    return SUPPORTED_ARCHITECTURES[name]


@dataclass
class ModelConfig:
    """The architecture of a Llama-family model, read from config.json or from GGUF metadata."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    dtype: torch.dtype = torch.float32
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )

    @classmethod
    def from_hf_dir(cls, path: str) -> ModelConfig:
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise ConfigError(f"{path} has no config.json: a model directory needs config.json and *.safetensors")
        with open(config_path) as f:
            hf = json.load(f)
        config = cls.from_hf_dict(hf)
        generation_path = os.path.join(path, "generation_config.json")
        if os.path.isfile(generation_path):
            with open(generation_path) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None:
                config.eos_token_ids = _as_list(eos)
        return config

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        architectures = hf.get("architectures") or ["LlamaForCausalLM"]
        architecture = check_architecture(architectures[0])
        num_heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        # transformers 5 moved rope_theta/rope_scaling into rope_parameters.
        rope = dict(hf.get("rope_parameters") or {})
        rope_theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            scaling = dict(scaling)
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind not in ("default", "llama3"):
                raise ConfigError(f"rope scaling type {kind!r} is not supported (supported: default, llama3)")
            scaling = scaling if kind == "llama3" else None
        dtype_name = hf.get("torch_dtype", hf.get("dtype", "float32")) or "float32"
        return cls(
            architecture=architecture,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hidden // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            dtype=getattr(torch, str(dtype_name).replace("torch.", ""), torch.float32),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_as_list(hf.get("eos_token_id")),
        )


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def check_tensor_parallel_size(config: ModelConfig, tensor_parallel_size: int, device_type: str = "cpu",
                               num_gpus: int | None = None) -> None:
    """Raise ConfigError unless `tensor_parallel_size` ranks can each hold a whole share of the heads, KV
    heads and MLP columns (the vocabulary is padded, so it need not divide) and, on CUDA, a GPU each.
    num_gpus defaults to torch.cuda.device_count()."""
    size = tensor_parallel_size
    if not isinstance(size, int) or size < 1:
        raise ConfigError(f"tensor_parallel_size must be a positive integer, not {size!r}")
    for what, n in (("num_attention_heads", config.num_heads), ("num_key_value_heads", config.num_kv_heads),
                    ("intermediate_size", config.intermediate_size)):
        if n % size:
            raise ConfigError(f"tensor_parallel_size={size} does not divide the model's {what}={n}: "
                              "pick a size that divides it")
    if device_type == "cuda" and size > 1:
        available = torch.cuda.device_count() if num_gpus is None else num_gpus
        if size > available:
            raise ConfigError(f"tensor_parallel_size={size} needs {size} GPUs, but {available} are visible")


@dataclass
class EngineConfig:
    """How the engine runs: memory, batch limits, scheduling policy. Names and defaults follow vLLM."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    cpu_kv_cache_gb: float = 2.0
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    scheduling: str = "continuous"
    # Schedule step N+1 while the GPU runs step N (None: on for CUDA, where the host is the bottleneck;
    # off on the CPU, where nothing runs concurrently and a stopped sequence's extra token would cost).
    async_scheduling: bool | None = None
    tensor_parallel_size: int = 1
    skip_tokenizer_init: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.scheduling not in ("continuous", "static"):
            raise ConfigError(f"scheduling must be 'continuous' or 'static', not {self.scheduling!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, not {self.block_size}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be at least 1, not {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be at least 1, not {self.max_num_batched_tokens}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], not {self.gpu_memory_utilization}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be at least 1, not {self.num_kv_blocks}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be a positive integer, not {self.tensor_parallel_size!r}")

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError("device='cuda' was asked for but torch sees no CUDA GPU")
        return torch.device(self.device)

    def resolve_async_scheduling(self, device: torch.device) -> bool:
        return device.type == "cuda" if self.async_scheduling is None else self.async_scheduling

    def resolve_dtype(self, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
        """'auto' is float32 on the CPU and the checkpoint's half type (bf16 if it has none) on a GPU."""
        if self.dtype == "auto":
            if device.type == "cpu":
                return torch.float32
            return model_dtype if model_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
        names = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
                 "half": torch.float16, "bfloat16": torch.bfloat16}
        if self.dtype not in names:
            raise ConfigError(f"dtype must be one of auto, {', '.join(names)}; not {self.dtype!r}")
        return names[self.dtype]
