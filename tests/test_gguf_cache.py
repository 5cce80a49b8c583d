"""The GGUF conversion cache is keyed by the file's content, so that copies of one GGUF (another checkout,
venv or path) share one entry, and a changed file gets a new one."""

import json
import os
import shutil

import pytest

from tinyvllm.model import gguf_loader
from tinyvllm.model.gguf_loader import gguf_cache_dir, gguf_cache_key

MIB = 1 << 20


def _write(path, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def _fake_gguf(size: int = 5 * MIB) -> bytearray:
    """Bytes that differ everywhere, so that a change anywhere is a change the key could see."""
    return bytearray(os.urandom(size))


def test_copies_at_different_paths_share_a_key(tmp_path):
    data = _fake_gguf()
    a = _write(tmp_path / "a.gguf", data)
    os.makedirs(tmp_path / "elsewhere")
    b = _write(tmp_path / "elsewhere" / "renamed.gguf", data)
    os.utime(b, (1_000_000, 1_000_000))  # another mtime, as a fresh copy or download has
    assert gguf_cache_key(a) == gguf_cache_key(b)


@pytest.mark.parametrize("offset", [0, 5 * MIB // 2, 5 * MIB - 1])
def test_a_change_in_a_sampled_chunk_changes_the_key(tmp_path, offset):
    data = _fake_gguf()
    a = _write(tmp_path / "a.gguf", data)
    data[offset] ^= 0xFF
    b = _write(tmp_path / "b.gguf", data)
    assert gguf_cache_key(a) != gguf_cache_key(b)


def test_a_change_in_size_changes_the_key(tmp_path):
    data = _fake_gguf()
    a = _write(tmp_path / "a.gguf", data)
    b = _write(tmp_path / "b.gguf", data + b"\0")
    assert gguf_cache_key(a) != gguf_cache_key(b)


def test_a_small_file_is_hashed_whole(tmp_path):
    data = _fake_gguf(3 * MIB)
    a = _write(tmp_path / "a.gguf", data)
    for offset in range(0, len(data), MIB // 4):  # every quarter MiB: no gap between the three chunks
        changed = bytearray(data)
        changed[offset] ^= 1
        assert gguf_cache_key(_write(tmp_path / "b.gguf", changed)) != gguf_cache_key(a)


def test_the_cache_format_is_part_of_the_key(tmp_path, monkeypatch):
    path = _write(tmp_path / "a.gguf", _fake_gguf(MIB))
    key = gguf_cache_key(path)
    monkeypatch.setattr(gguf_loader, "CACHE_FORMAT", gguf_loader.CACHE_FORMAT + 1)
    assert gguf_cache_key(path) != key


def test_cache_dir_is_under_tinyvllm_cache_dir(tmp_path, monkeypatch):
    data = _fake_gguf(MIB)
    a = _write(tmp_path / "a.gguf", data)
    b = _write(tmp_path / "b.gguf", data)
    monkeypatch.setenv("TINYVLLM_CACHE_DIR", str(tmp_path / "cache"))
    assert gguf_cache_dir(a) == gguf_cache_dir(b) == str(tmp_path / "cache" / f"gguf-{gguf_cache_key(a)}")
    monkeypatch.delenv("TINYVLLM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gguf_cache_dir(a).startswith(str(tmp_path / "xdg" / "tinyvllm") + os.sep)


def test_unreadable_file_is_a_model_load_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read .*missing.gguf"):
        gguf_cache_key(str(tmp_path / "missing.gguf"))


@pytest.mark.slow
def test_embedded_model_copy_shares_the_entry_and_a_stale_config_is_replaced(tmp_path, monkeypatch):
    """A copy of the embedded GGUF maps to the same entry; a cached config another version wrote (here: a
    field this one does not have) is read again from the GGUF instead of failing the load."""
    from tinyvllm.model.loader import embedded_model_path, load_model_config

    original = embedded_model_path()
    copy = str(tmp_path / "copy.gguf")
    shutil.copyfile(original, copy)
    monkeypatch.setenv("TINYVLLM_CACHE_DIR", str(tmp_path / "cache"))
    entry = gguf_cache_dir(original)
    assert gguf_cache_dir(copy) == entry
    os.makedirs(entry)
    with open(os.path.join(entry, "tinyvllm_config.json"), "w") as f:
        json.dump({"architecture": "LlamaForCausalLM", "no_such_field": 1}, f)
    config = load_model_config(copy)
    assert (config.num_layers, config.num_heads, config.vocab_size) == (30, 9, 49152)
    with open(os.path.join(entry, "tinyvllm_config.json")) as f:
        assert json.load(f)["num_heads"] == 9
