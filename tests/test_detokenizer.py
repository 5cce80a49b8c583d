"""Incremental detokenization emits complete characters only, and adds up to the full decode."""

from transformers import AutoTokenizer

from tinyvllm.tokenizer import IncrementalDetokenizer


def test_multibyte_characters_split_across_tokens(smol_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(smol_tokenizer_dir)
    text = "Grüße aus Köln — 日本語のテキスト 🎉🚀 naïve café"
    ids = tokenizer.encode(text)
    # byte-level BPE splits some of these characters over several tokens
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.flush())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert detok.text == text


def test_dangling_partial_character_is_flushed(smol_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(smol_tokenizer_dir)
    ids = tokenizer.encode("🎉")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(ids[0]) == ""
    assert detok.flush() == tokenizer.decode(ids[:1])
