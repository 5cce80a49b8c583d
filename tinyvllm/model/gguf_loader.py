"""GGUF files (llama.cpp's format): config from the metadata, tensors read from the memory-mapped file.

Architectures (general.architecture): llama (Mistral too: llama.cpp writes it as llama), qwen2, qwen3 and gemma2, each
loaded into the family that config.check_architecture names. Where llama.cpp's converter (convert_hf_to_gguf.py)
changed a tensor, we change it back, so that the families load what a Hugging Face checkpoint holds: for llama it
permutes the rows of Q and K so that its rotary kernel can rotate adjacent pairs (we undo that permutation, of a
4-bit tensor's rows as of a float one's, and keep Hugging Face's rotate-half layout; the other architectures rotate
halves in llama.cpp too and are written as they are); for gemma2 it adds 1 to the RMSNorm weights (NORM_OFFSETS).

On the CPU with one rank (iter_gguf_tensors with int4=...), tensors are read straight from the file: the 4-bit
types (INT4_TYPES) as their 4-bit values with a scale and a zero per group of 32 (int4_groups), which
model/quantization.py packs for torch's int4 kernel, the others dequantized with `gguf` one tensor at a time.
Nothing is written. Elsewhere (a GPU, tensor parallelism) the weights load dequantized: the first load writes
them to ~/.cache/tinyvllm and later loads read those instead (a tensor-parallel rank reads only its shard of
them). The cache is keyed by the file's content (gguf_cache_key), so that every checkout, venv or copy of one
GGUF shares one entry (~0.5 GB for the embedded model). The config read from the metadata is cached in the
same entry on every path: parsing a 49k-token vocabulary's metadata takes seconds."""

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

# GGUF tensor name (after "blk.N.") -> our parameter name (after "model.layers.N."), llama.cpp's names (gguf's
# TensorNameMap) of every family's tensors: each appears in the files of the architectures that have it (q_norm and
# k_norm: qwen3; the post-norms: gemma2). A weight's bias (qwen2's attn_q.bias, ...) maps as its weight.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# An architecture's names where they differ from _LAYER_NAMES: llama.cpp calls the norm before the MLP ffn_norm in
# every family, which is Llama's post_attention_layernorm but Gemma 2's pre_feedforward_layernorm (its
# post_attention_layernorm is the norm on attention's output, post_attention_norm).
_ARCH_LAYER_NAMES = {"gemma2": {"ffn_norm": "pre_feedforward_layernorm"}}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# The architectures whose Q and K rows llama.cpp's converter permutes (its LlamaModel.permute).
PERMUTED_QK_ARCHITECTURES = frozenset({"llama"})
# What llama.cpp's converter adds to an architecture's RMSNorm weights (every tensor named *norm.weight): Gemma's norm
# scales by 1 + w and llama.cpp's by its weight, so Gemma2Model.modify_tensors writes 1 + w. We subtract it again:
# the family's norm (GemmaRMSNorm) adds the 1 as it loads, as it does to a Hugging Face checkpoint's w.
NORM_OFFSETS = {"gemma2": 1.0}
# GGUF metadata (after "<arch>.") -> the config.json field that a family reads from ModelConfig.hf_config. Absent
# keys leave the family's default, which is llama.cpp's too (Gemma 2's soft caps 50 and 30).
_HF_CONFIG_KEYS = {
    "attention.sliding_window": "sliding_window",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
}
# Gemma 2's layer count at 27B, the one size whose query_pre_attn_scalar llama.cpp takes as hidden / heads rather
# than head_dim (llama-model.cpp, LLM_ARCH_GEMMA2; the GGUF does not store the scalar).
_GEMMA2_27B_LAYERS = 46

# Types whose values are 4-bit with a scale and a zero (an offset) per group of 32 weights: each maps exactly onto
# torch's int4 groups, w = (q - 8) * scale + zero. Q4_0: w = d (q - 8); Q4_1: w = d q + m; Q4_K: super-blocks of 256
# with a 6-bit scale and min per sub-block of 32, w = (d sc) q - (dmin m). Q5_*, Q6_K, Q8_0 and Q2_K/Q3_K have more
# or other bits per weight than a 4-bit group holds, so they are dequantized.
INT4_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K"})
# Q8_0 (w = d q, q an int8, a float16 d per 32) is two 4-bit groups exactly: q = 16 hi + lo with hi in [-8, 7] and lo
# in [0, 15], so w = (16 d) hi + d lo, each half one of torch's int4 groups (model/quantization.py).
INT8_TYPES = frozenset({"Q8_0"})
KEPT_TYPES = INT4_TYPES | INT8_TYPES
FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})
INT4_GROUP = 32


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


def gguf_architecture(path: str) -> str:
    """The file's general.architecture (llama, qwen2, ...)."""
    field = _reader(path).fields.get("general.architecture")
    return "?" if field is None else str(field.contents())


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
    num_layers = int(get("block_count"))
    head_dim = int(get("attention.key_length", get("rope.dimension_count", hidden // num_heads)))
    hf_config = {field: get(key) for key, field in _HF_CONFIG_KEYS.items() if f"{arch}.{key}" in meta}
    if arch == "gemma2":
        hf_config["query_pre_attn_scalar"] = hidden // num_heads if num_layers == _GEMMA2_27B_LAYERS else head_dim
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=sorted({int(e) for e in eos}),
        hf_config=hf_config,
    )


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's convert permute: rows (head, pair, 2) back to (head, 2, half)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_tensor_types(path: str) -> dict[str, str]:
    """{our parameter name: the GGUF type of its tensor (Q4_1, Q8_0, F32, ...)} for every weight in the file."""
    arch = gguf_architecture(path)
    return {_parameter_name(path, arch, t.name): t.tensor_type.name for t in _reader(path).tensors
            if t.name != "rope_freqs.weight"}


def release_reader(path: str) -> None:
    """Drop the parsed file (its memory map and metadata arrays) once the weights are in: nothing reads it after
    the load, and its pages would count in the process's resident memory."""
    _reader.cache_clear()


def iter_gguf_tensors(path: str, config: ModelConfig, lazy: bool = False,
                      int4: frozenset[str] | None = None) -> Iterator[tuple[str, Any]]:
    """(Hugging Face parameter name, tensor) for every weight in the file.

    int4 given (the CPU, one rank): straight from the memory-mapped file, nothing cached. The weights named in
    `int4` (of KEPT_TYPES) come as two tensors: `name` their values and `name`_scale their scales (and zeros):
    int4_groups, int8_groups; the others dequantized to float32, one at a time.

    int4 None: every weight dequantized to float32, through the conversion cache. lazy: once the file is
    converted, safetensors slices of the cached conversion instead, so that a tensor-parallel rank reads only its
    shard (the first load dequantizes everything, once per rank)."""
    if int4 is not None:
        yield from _read_tensors(path, config, int4)
        return
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
        for name, array in _read_tensors(path, config, frozenset()):
            tensors[name] = torch.from_numpy(array)
            bar.update(1)
        bar.set_postfix_str("saving")
        _write_cache_file(cached, lambda tmp: save_file(tensors, tmp))
        bar.set_postfix_str("")
        bar.update(bar.total - bar.n)
    yield from tensors.items()


def _parameter_name(path: str, arch: str, gguf_name: str) -> str:
    """Our (Hugging Face) parameter name of a GGUF tensor of architecture `arch`."""
    prefix, _, suffix = gguf_name.rpartition(".")  # suffix: weight or bias
    if prefix.startswith("blk."):
        _, layer, short = prefix.split(".", 2)
        names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
        if short in names:
            return f"model.layers.{layer}.{names[short]}.{suffix}"
    elif prefix in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[prefix]}.{suffix}"
    raise ModelLoadError(f"{path}: unexpected tensor {gguf_name}")


def _read_tensors(path: str, config: ModelConfig, int4: frozenset[str]) -> Iterator[tuple[str, Any]]:
    import gguf

    arch = gguf_architecture(path)
    permuted, norm_offset = arch in PERMUTED_QK_ARCHITECTURES, NORM_OFFSETS.get(arch, 0.0)
    for tensor in _reader(path).tensors:
        if tensor.name == "rope_freqs.weight":
            continue
        qtype = tensor.tensor_type.name
        if qtype not in SUPPORTED_QUANT_TYPES:
            raise ModelLoadError(
                f"{path}: tensor {tensor.name} is quantized as {qtype}, which tinyvllm cannot read "
                f"(supported: {', '.join(sorted(SUPPORTED_QUANT_TYPES))})"
            )
        name = _parameter_name(path, arch, tensor.name)
        # ggml lists shapes fastest-dimension first; numpy's (and torch's) order is the reverse.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        heads = (None if not permuted else config.num_heads if tensor.name.endswith("attn_q.weight") else
                 config.num_kv_heads if tensor.name.endswith("attn_k.weight") else None)
        if name in int4:
            if qtype not in KEPT_TYPES:
                raise ModelLoadError(f"{path}: tensor {tensor.name} is {qtype}, not one of {sorted(KEPT_TYPES)}")
            values, scale_zero = (int4_groups if qtype in INT4_TYPES else int8_groups)(tensor.data, qtype, shape)
            if heads is not None:
                values, scale_zero = _unpermute(values, heads), _unpermute(scale_zero, heads)
            yield name, values
            yield f"{name}_scale", scale_zero
            continue
        array = np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
        if norm_offset and tensor.name.endswith("norm.weight"):
            array -= norm_offset
        yield name, array if heads is None else _unpermute(array, heads)


def int4_groups(data: np.ndarray, qtype: str, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """A tensor of a 4-bit type (INT4_TYPES; its raw blocks, [rows, bytes]) as (values, scale_zero): values uint8
    [rows, cols / 2], for each group of 32 weights 16 bytes whose byte j holds the group's value j in its low
    nibble and value j + 16 in its high one (Q4_0's own order); scale_zero float32 [rows, cols / 32, 2], each
    group's (scale, zero), so that w = (q - 8) * scale + zero, as torch's int4 kernel computes it. Exact: the
    scales are float16 times integers of at most 6 bits, so the products and the one sum (Q4_K's zero) are
    float32's rounding at most."""
    rows, cols = shape
    if cols % (256 if qtype == "Q4_K" else INT4_GROUP):
        raise ModelLoadError(f"a {qtype} tensor of {cols} columns does not split into its blocks")
    blocks = np.asarray(data).reshape(rows, -1).view(np.uint8)

    def f16(part: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(part).view(np.float16).astype(np.float32)

    if qtype in ("Q4_0", "Q4_1"):
        head = 2 if qtype == "Q4_0" else 4  # bytes before each block's 16 bytes of values: d (and m), float16
        blocks = blocks.reshape(rows, cols // 32, head + 16)
        values = blocks[..., head:].reshape(rows, cols // 2)
        scale = f16(blocks[..., 0:2])[..., 0]
        # Q4_0: d (q - 8) is zero 0; Q4_1: d q + m = d (q - 8) + (m + 8 d)
        zero = np.zeros_like(scale) if qtype == "Q4_0" else f16(blocks[..., 2:4])[..., 0] + 8 * scale
    else:  # Q4_K: d, dmin (float16), 12 bytes of 6-bit scales and mins, 128 bytes of values (4 runs of 32 bytes:
        #     the low nibbles are one sub-block, the high nibbles the next)
        blocks = blocks.reshape(rows, cols // 256, 144)
        d, dmin = f16(blocks[..., 0:2]), f16(blocks[..., 2:4])
        sc, mins = _q4_k_scales(blocks[..., 4:16])
        scale = (d * sc).reshape(rows, cols // 32)
        zero = (8 * d * sc - dmin * mins).reshape(rows, cols // 32)
        runs = blocks[..., 16:].reshape(rows, cols // 256, 4, 32)
        subblocks = np.stack([runs & 0x0F, runs >> 4], axis=3).reshape(rows, cols // 32, 32)
        values = (subblocks[..., :16] | (subblocks[..., 16:] << 4)).reshape(rows, cols // 2)
    return np.ascontiguousarray(values), np.stack([scale, zero], axis=-1).astype(np.float32)


def int8_groups(data: np.ndarray, qtype: str, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 tensor (raw blocks [rows, bytes]) as (values int8 [rows, cols], scales float32 [rows, cols / 32]):
    w = scale * q, exactly."""
    rows, cols = shape
    if cols % INT4_GROUP:
        raise ModelLoadError(f"a {qtype} tensor of {cols} columns does not split into its blocks")
    blocks = np.asarray(data).reshape(rows, cols // 32, 34).view(np.uint8)
    scales = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
    return np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, cols), scales


def _q4_k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes per super-block -> (scales, mins) of its 8 sub-blocks, float32 [..., 8]: bytes 0-3 hold
    the low 6 bits of scales 0-3, 4-7 those of mins 0-3, 8-11 the low 4 bits of scales and mins 4-7, whose high
    2 bits are the top bits of bytes 0-3 (scales) and 4-7 (mins)."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)
