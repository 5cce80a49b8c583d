"""Tokenizers and chat templates come from transformers; this file finds them and detokenizes
incrementally."""

from __future__ import annotations

import os
import shutil
from typing import Any

from tinyvllm.model.gguf_loader import conversion_progress, gguf_cache_dir, remove_partial
from tinyvllm.model.loader import ModelLoadError, is_gguf


def load_tokenizer(path: str) -> Any:
    """AutoTokenizer for a model directory, or the tokenizer built from a GGUF file's metadata.

    Building a tokenizer from GGUF metadata is slow in transformers (it converts 49k merges in Python),
    so the result is saved once beside the GGUF's other converted files, in the cache entry
    keyed by the file's content (see gguf_loader.gguf_cache_dir)."""
    from transformers import AutoTokenizer

    if not is_gguf(path):
        try:
            return AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot load a tokenizer from {path}: {e}") from e
    cached = os.path.join(gguf_cache_dir(path), "tokenizer")
    broken = False
    if os.path.isfile(os.path.join(cached, "tokenizer.json")):
        try:
            return AutoTokenizer.from_pretrained(cached)
        except (OSError, ValueError):
            broken = True  # damaged, or saved by a transformers this one cannot read: convert again
    with conversion_progress(f"Converting {os.path.basename(path)}: tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    tmp = f"{cached}.tmp{os.getpid()}"
    try:
        tokenizer.save_pretrained(tmp)
        if broken:
            shutil.rmtree(cached)  # os.replace cannot replace a non-empty directory
        os.replace(tmp, cached)  # atomic: a concurrent reader sees all of it or nothing
    except OSError:
        pass  # a read-only home, or another process saved it first: only costs the conversion next time
    finally:
        remove_partial(tmp)
    return tokenizer


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, emitting only complete characters.

    A multi-byte UTF-8 character split across tokens decodes to U+FFFD until its last byte arrives,
    so text is emitted from a window of recent tokens only once it no longer ends in U+FFFD (the
    prefix/read offsets of vLLM's detokenizer)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Appends one token; returns the text it completes (possibly empty)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            new_text = full_text[len(prefix_text):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            self.text += new_text
            return new_text
        return ""

    def flush(self) -> str:
        """At the end, whatever is left (a dangling partial character decodes to U+FFFD)."""
        rest = self._decode(self.token_ids[self.prefix_offset:])[len(
            self._decode(self.token_ids[self.prefix_offset:self.read_offset])):]
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += rest
        return rest
