"""GGUF files (llama.cpp's format): config from the metadata, tensors dequantized with `gguf`.

llama.cpp's converter permutes the rows of Q and K so that its rotary kernel can rotate adjacent
pairs; we undo that permutation and keep Hugging Face's rotate-half layout.

Parsing a GGUF's metadata takes `gguf` ~9 s for a 49k-token vocabulary and dequantizing a few more,
so the first load writes the config and the dequantized tensors to ~/.cache/tinyvllm (keyed by the
file's path, size and mtime) and later loads read those instead."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from tinyvllm.config import ModelConfig, check_architecture
from tinyvllm.model.checkpoint import ModelLoadError, iter_safetensors_file

# ggml tensor type names we dequantize (all are handled by gguf.quants).
SUPPORTED_QUANT_TYPES = {
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
}

# GGUF tensor name (after "blk.N.") -> our parameter name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@lru_cache(maxsize=4)
def _reader(path: str) -> Any:
    try:
        import gguf
    except ImportError as e:
        raise ModelLoadError("reading GGUF files needs the `gguf` package: pip install gguf") from e
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # gguf raises ValueError, struct.error, ... on a damaged file
        raise ModelLoadError(f"cannot read {path}: not a valid GGUF file ({e})") from e


def gguf_metadata(path: str) -> dict[str, Any]:
    """The file's key-value metadata, without the (large) tokenizer arrays."""
    reader = _reader(path)
    skip = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")
    return {key: field.contents() for key, field in reader.fields.items() if key not in skip}


def gguf_cache_dir(path: str) -> str:
    """Where the conversion of this GGUF file (config, tensors, tokenizer) is kept."""
    root = os.environ.get("TINYVLLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tinyvllm")
    stat = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return os.path.join(root, f"{os.path.basename(path)}-{key}")


def _write_cache_file(path: str, write: Any) -> None:
    """Write atomically (a temp file then a rename); a read-only cache only costs time later."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        write(tmp)
        os.replace(tmp, path)
    except OSError:
        pass


def gguf_model_config(path: str) -> ModelConfig:
    cached = os.path.join(gguf_cache_dir(path), "tinyvllm_config.json")
    if os.path.isfile(cached):
        with open(cached) as f:
            fields = json.load(f)
        return ModelConfig(**{**fields, "dtype": torch.float32})
    config = _read_gguf_config(path)
    fields = {k: v for k, v in dataclasses.asdict(config).items() if k != "dtype"}
    _write_cache_file(cached, lambda tmp: open(tmp, "w").write(json.dumps(fields)))
    return config


def _read_gguf_config(path: str) -> ModelConfig:
    meta = gguf_metadata(path)
    arch = meta.get("general.architecture", "?")
    check_architecture(arch)

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    reader = _reader(path)
    tensor_names = {t.name for t in reader.tensors}
    num_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = get("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    scaling = None
    if "rope_freqs.weight" in tensor_names:
        factors = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        scaling = {"rope_type": "freq_factors", "freq_factors": np.asarray(factors.data, np.float32).tolist()}
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    return ModelConfig(
        architecture=check_architecture(arch),
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=int(get("attention.key_length", get("rope.dimension_count", hidden // num_heads))),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=sorted({int(e) for e in eos}),
    )


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's convert permute: rows (head, pair, 2) back to (head, 2, half)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def iter_gguf_tensors(path: str, config: ModelConfig, lazy: bool = False) -> Iterator[tuple[str, Any]]:
    """(Hugging Face parameter name, float32 tensor) for every weight in the file. lazy: once the file is
    converted, safetensors slices of the cached conversion instead, so that a tensor-parallel rank reads
    only its shard (the first load dequantizes everything, once per rank)."""
    from safetensors.torch import load_file, save_file

    cached = os.path.join(gguf_cache_dir(path), "model.safetensors")
    if os.path.isfile(cached) and lazy:
        yield from iter_safetensors_file(cached, lazy=True)
        return
    if os.path.isfile(cached):
        yield from load_file(cached).items()
        return
    tensors = {name: torch.from_numpy(array) for name, array in _dequantize_all(path, config)}
    _write_cache_file(cached, lambda tmp: save_file(tensors, tmp))
    yield from tensors.items()


def _dequantize_all(path: str, config: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    import gguf

    for tensor in _reader(path).tensors:
        if tensor.name == "rope_freqs.weight":
            continue
        qtype = tensor.tensor_type.name
        if qtype not in SUPPORTED_QUANT_TYPES:
            raise ModelLoadError(
                f"{path}: tensor {tensor.name} is quantized as {qtype}, which tinyvllm cannot read "
                f"(supported: {', '.join(sorted(SUPPORTED_QUANT_TYPES))})"
            )
        prefix, _, suffix = tensor.name.rpartition(".")  # suffix: weight or bias
        if prefix.startswith("blk."):
            _, layer, short = prefix.split(".", 2)
            if short not in _LAYER_NAMES:
                raise ModelLoadError(f"{path}: unexpected tensor {tensor.name}")
            name = f"model.layers.{layer}.{_LAYER_NAMES[short]}.{suffix}"
        elif prefix in _GLOBAL_NAMES:
            name = f"{_GLOBAL_NAMES[prefix]}.{suffix}"
        else:
            raise ModelLoadError(f"{path}: unexpected tensor {tensor.name}")
        # ggml lists shapes fastest-dimension first; numpy's (and torch's) order is the reverse.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        array = np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
        if prefix.endswith("attn_q"):
            array = _unpermute(array, config.num_heads)
        elif prefix.endswith("attn_k"):
            array = _unpermute(array, config.num_kv_heads)
        yield name, array
