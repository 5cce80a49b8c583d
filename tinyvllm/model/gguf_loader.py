"""GGUF files (llama.cpp's format): config from the metadata, tensors dequantized with `gguf`.

llama.cpp's converter permutes the rows of Q and K so that its rotary kernel can rotate adjacent
pairs; we undo that permutation and keep Hugging Face's rotate-half layout.

Parsing a GGUF's metadata for a 49k-token vocabulary and dequantizing its tensors take seconds, so the
first load writes the config and the dequantized tensors to ~/.cache/tinyvllm and later loads
read those instead. The cache is keyed by the file's content (gguf_cache_key), so that every checkout,
venv or copy of one GGUF shares one entry (~0.5 GB for the embedded model)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from tinyvllm.config import ConfigError, ModelConfig, check_architecture
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


# Bump when what a cache entry holds changes (its files, the config's fields, tensor names or layout): the
# entry is keyed by content, so every version of tinyvllm would otherwise read what another one wrote.
CACHE_FORMAT = 1
# The key hashes this much from the start, the middle and the end of the file.
_KEY_CHUNK = 1 << 20
_REQUIRED: Any = object()


@contextmanager
def conversion_progress(desc: str) -> Iterator[None]:
    """A progress line around one slow step of a GGUF's first load that reports no progress of its own
    (gguf parsing the metadata, transformers converting the tokenizer): without it the first load is
    many seconds of silence. It shows `desc` at once and the time taken when the step ends."""
    from tqdm.auto import tqdm

    with tqdm(total=1, desc=desc, bar_format="{desc}: {elapsed}", dynamic_ncols=True) as bar:
        yield
        bar.update(1)


@lru_cache(maxsize=4)
def _reader(path: str) -> Any:
    try:
        import gguf
    except ImportError as e:
        raise ModelLoadError("reading GGUF files needs the `gguf` package: pip install gguf") from e
    with conversion_progress(f"Converting {os.path.basename(path)}: reading metadata"):
        try:
            return gguf.GGUFReader(path)
        except Exception as e:  # gguf raises ValueError, struct.error, ... on a damaged file
            raise ModelLoadError(f"cannot read {path}: not a valid GGUF file ({e})") from e


def gguf_metadata(path: str) -> dict[str, Any]:
    """The file's key-value metadata, without the (large) tokenizer arrays."""
    reader = _reader(path)
    skip = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")
    return {key: field.contents() for key, field in reader.fields.items() if key not in skip}


def gguf_cache_root() -> str:
    """$TINYVLLM_CACHE_DIR, else $XDG_CACHE_HOME/tinyvllm, else ~/.cache/tinyvllm."""
    return os.environ.get("TINYVLLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tinyvllm")


def gguf_cache_key(path: str) -> str:
    """A key for the file's content: a SHA-256 of its size and of its first, middle and last MiB (all of a
    file of up to 3 MiB), so that the same GGUF at another path, in another checkout or venv, or with
    another mtime finds the same cache entry, and reading 3 MiB costs milliseconds where hashing a
    multi-GB model would cost seconds on every load. Different models differ in those chunks (metadata
    and tensor data); a file edited in place outside them, at the same size, keeps its key: delete its
    entry (gguf_cache_dir) then. CACHE_FORMAT is part of the key."""
    try:
        size = os.path.getsize(path)
        digest = hashlib.sha256(f"tinyvllm-gguf-cache-v{CACHE_FORMAT}:{size}".encode())
        with open(path, "rb") as f:
            for offset in (0, max(0, (size - _KEY_CHUNK) // 2), max(0, size - _KEY_CHUNK)):
                f.seek(offset)
                digest.update(f.read(_KEY_CHUNK))
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e.strerror}") from e
    return digest.hexdigest()[:20]


def gguf_cache_dir(path: str) -> str:
    """Where the conversion of this GGUF file (config, tensors, tokenizer) is kept: one directory per
    content (see gguf_cache_key) under gguf_cache_root()."""
    return os.path.join(gguf_cache_root(), f"gguf-{gguf_cache_key(path)}")


def _write_cache_file(path: str, write: Callable[[str], object]) -> None:
    """Write atomically (a temp file then a rename), so that a concurrent or interrupted load never sees
    half a file; a read-only or full cache only costs a conversion next time."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write(tmp)
        os.replace(tmp, path)
    except OSError:
        remove_partial(tmp)


def remove_partial(tmp: str) -> None:
    """Remove a half-written cache file or directory, if there is one."""
    if os.path.isdir(tmp):
        shutil.rmtree(tmp, ignore_errors=True)
    elif os.path.lexists(tmp):
        try:
            os.remove(tmp)
        except OSError:
            pass


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def gguf_model_config(path: str) -> ModelConfig:
    """The model's config: from the cache, or read from the GGUF's metadata and cached."""
    cached = os.path.join(gguf_cache_dir(path), "tinyvllm_config.json")
    if os.path.isfile(cached):
        try:
            with open(cached, encoding="utf-8") as f:
                return ModelConfig(**{**json.load(f), "dtype": torch.float32})
        except (OSError, ValueError, TypeError):
            pass  # damaged, or fields another version of tinyvllm wrote: read the metadata again
    config = _read_gguf_config(path)
    fields = {k: v for k, v in dataclasses.asdict(config).items() if k != "dtype"}
    _write_cache_file(cached, lambda tmp: _write_text(tmp, json.dumps(fields)))
    return config


def _read_gguf_config(path: str) -> ModelConfig:
    meta = gguf_metadata(path)
    arch = meta.get("general.architecture", "?")
    try:
        architecture = check_architecture(arch)
    except ConfigError as e:
        raise type(e)(f"{path}: {e}") from None

    def get(key: str, default: Any = _REQUIRED) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is _REQUIRED:
            raise ModelLoadError(f"{path}: the GGUF metadata lacks {arch}.{key}, which the model needs "
                                 "(the file is incomplete, or was not written by llama.cpp's converter)")
        return value

    reader = _reader(path)
    tensor_names = {t.name for t in reader.tensors}
    num_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = get("vocab_size", None)
    if vocab is None:
        if "tokenizer.ggml.tokens" not in reader.fields:
            raise ModelLoadError(f"{path}: the GGUF metadata has neither {arch}.vocab_size nor a tokenizer "
                                 "vocabulary, so the model's vocabulary size is unknown")
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    scaling = None
    if "rope_freqs.weight" in tensor_names:
        factors = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        scaling = {"rope_type": "freq_factors", "freq_factors": np.asarray(factors.data, np.float32).tolist()}
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    return ModelConfig(
        architecture=architecture,
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
    from tqdm.auto import tqdm

    reader = _reader(path)
    tensors = {}
    with tqdm(total=len(reader.tensors) + 1, desc=f"Converting {os.path.basename(path)}: tensors",
              unit="tensor", dynamic_ncols=True) as bar:
        for name, array in _dequantize_all(path, config):
            tensors[name] = torch.from_numpy(array)
            bar.update(1)
        bar.set_postfix_str("saving")
        _write_cache_file(cached, lambda tmp: save_file(tensors, tmp))
        bar.set_postfix_str("")
        bar.update(bar.total - bar.n)
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
