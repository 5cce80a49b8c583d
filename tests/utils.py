"""Helpers shared by the tests: small random-weight Llama checkpoints and direct model access."""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest
import torch

from tinyvllm.ops import AttentionMetadata

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=0,
            eos_token_id=1, initializer_range=0.1)


def save_tiny_llama(path: str, seed: int = 0, max_shard_size: str | None = None, tokenizer_dir: str | None = None,
                    dtype: torch.dtype = torch.float32, **overrides: Any) -> str:
    """A random-weight LlamaForCausalLM saved as a safetensors directory (sharded if asked)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY, **overrides})
    model = LlamaForCausalLM(config).to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    if tokenizer_dir is not None:
        for name in os.listdir(tokenizer_dir):
            with open(os.path.join(tokenizer_dir, name), "rb") as src, open(os.path.join(path, name), "wb") as dst:
                dst.write(src.read())
    return path


def tiny_llama_fixture(seed: int) -> Any:
    """A module-scoped `checkpoint` fixture: one tiny random Llama, saved once for the module's tests
    (assign it to the name `checkpoint`)."""

    @pytest.fixture(scope="module")
    def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
        return save_tiny_llama(str(tmp_path_factory.mktemp("tiny")), seed=seed)

    return checkpoint


def tiny_llm(path: str, **kwargs: Any) -> Any:
    """An LLM over a tiny checkpoint on the CPU, token ids in and out."""
    from tinyvllm import LLM

    return LLM(path, skip_tokenizer_init=True, device="cpu", **kwargs)


def hf_model(path: str) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def our_logits(llm: Any, token_ids: list[int]) -> torch.Tensor:
    """Logits at every position of one sequence, through our model and a scratch block table."""
    engine = llm.llm_engine
    runner = engine.engine_core.model_runner
    bs = runner.block_size
    n = len(token_ids)
    num_blocks = (n + bs - 1) // bs
    assert engine.engine_core.block_manager.num_free_blocks == engine.engine_core.block_manager.num_blocks
    blocks = list(range(num_blocks))
    device = runner.device
    meta = AttentionMetadata(
        cu_query_lens=torch.tensor([0, n], dtype=torch.int32, device=device),
        context_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_tables=torch.tensor([blocks], dtype=torch.int32, device=device),
        slot_mapping=torch.arange(n, device=device),
        max_query_len=n, max_context_len=n)
    ids = torch.tensor(token_ids, device=device)
    hidden = runner.model(ids, torch.arange(n, device=device), meta)
    return runner.model.compute_logits(hidden).float()


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy continuation by full forward passes (no cache, no EOS handling): the plainest reference."""
    ids = list(prompt)
    for _ in range(num_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# ---- the GPU checks' model and attention batches (tests/gpu): copied from benchmarks/common.py, which tests do
# not import

LLAMA_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    bos_token_id=128000, eos_token_id=128001, initializer_range=0.02,
)


def random_llama(path: str, shape: dict, dtype: str = "bfloat16") -> str:
    """Saves (once) a random-weight LlamaForCausalLM of `shape` (seed 0, built on the GPU when there is one) and
    returns its directory: the same checkpoint as benchmarks/common.py's random_llama."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**shape)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    # Saved beside, then renamed into place: a run that starts meanwhile finds a whole checkpoint or none.
    partial = f"{path}.partial-{os.getpid()}"
    model.save_pretrained(partial)
    del model
    try:
        os.rename(partial, path)
    except OSError:  # another process saved it first (else a directory is in the way: say so)
        shutil.rmtree(partial, ignore_errors=True)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # an engine started next sizes its KV cache from the memory left free
    return path


def random_llama_1b(path: str = "/tmp/llama-1b-random") -> str:
    """The random-weight bf16 Llama-3.2-1B-shaped checkpoint of docs/benchmarks.md (the path the benchmarks
    use: the same weights, saved once for both)."""
    return random_llama(path, LLAMA_1B)


def attention_metadata(query_lens: list[int], context_lens: list[int], block_tables: torch.Tensor) -> AttentionMetadata:
    """AttentionMetadata for a batch whose K/V are in the cache already (for checking attention alone:
    slot_mapping is all zeros, as no op here stores K/V)."""
    device = block_tables.device
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return AttentionMetadata(
        cu_query_lens=cu,
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        block_tables=block_tables,
        slot_mapping=torch.zeros(int(cu[-1]), dtype=torch.int64, device=device),
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
    )
