"""What both loaders share: the error for model files we cannot use, and reading safetensors files
(a Hugging Face directory's weights, and the GGUF loader's cached conversion).

It sits below loader and gguf_loader so that imports go one way: loader -> gguf_loader -> checkpoint."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from typing import Any


class ModelLoadError(ValueError):
    """The model's files are missing, unreadable or do not fit its config."""


def safetensors_files(path: str) -> list[str]:
    """The directory's safetensors shards, in the order its index lists them (or sorted, without one)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index (it needs a \"weight_map\" of "
                                 f"tensor name -> shard file): {e}") from e
        missing = [n for n in names if not os.path.isfile(os.path.join(path, n))]
        if missing:
            raise ModelLoadError(f"{path}: shards listed in model.safetensors.index.json are missing: {missing}")
        return [os.path.join(path, n) for n in names]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        pickles = glob.glob(os.path.join(path, "*.bin")) + glob.glob(os.path.join(path, "*.pt"))
        hint = " (it has pickled *.bin/*.pt weights, which tinyvllm never loads: convert them to safetensors)"
        raise ModelLoadError(f"{path} has no *.safetensors weights" + (hint if pickles else ""))
    return files


def iter_safetensors(path: str, lazy: bool = False) -> Iterator[tuple[str, Any]]:
    """(name, tensor) for every tensor in the directory; lazy: (name, safetensors slice) instead, indexed
    like a tensor, so that a tensor-parallel rank reads only its shard from the file."""
    for file in safetensors_files(path):
        yield from iter_safetensors_file(file, lazy)


def iter_safetensors_file(file: str, lazy: bool = False) -> Iterator[tuple[str, Any]]:
    """(name, tensor or lazy slice) for every tensor in one safetensors file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, (f.get_slice(name) if lazy else f.get_tensor(name))
    except (SafetensorError, OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {file}: it is not a valid safetensors file ({e})") from e
