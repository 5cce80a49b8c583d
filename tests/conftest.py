"""Shared test setup. TRITON_INTERPRET must be set before triton is first imported, so that the
Triton kernels run on CPU tensors under the interpreter (see shared/TOOLCHAIN.md)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smol_tokenizer_dir(tmp_path_factory):
    """The embedded SmolLM2 tokenizer saved as a Hugging Face tokenizer directory, to give small
    random-weight models a real tokenizer."""
    from tinyvllm.model.loader import embedded_model_path
    from tinyvllm.tokenizer import load_tokenizer

    path = tmp_path_factory.mktemp("smol-tokenizer")
    load_tokenizer(embedded_model_path()).save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="session")
def tiny_text_checkpoint(tmp_path_factory, smol_tokenizer_dir):
    """A random-weight Llama with SmolLM2's vocabulary and tokenizer: text in, text out, fast."""
    from tests.utils import save_tiny_llama

    path = str(tmp_path_factory.mktemp("tiny-text"))
    return save_tiny_llama(path, seed=7, vocab_size=49152, bos_token_id=1, eos_token_id=2,
                           tokenizer_dir=smol_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_text_llm(tiny_text_checkpoint):
    from tinyvllm import LLM

    return LLM(tiny_text_checkpoint, device="cpu", num_kv_blocks=128)
