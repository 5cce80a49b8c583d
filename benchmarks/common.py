"""Shared by the GPU benchmarks: the Llama-3.2-1B-shaped random-weight model of docs/benchmarks.md."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LLAMA_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    bos_token_id=128000, eos_token_id=128001, initializer_range=0.02,
)


# The same architecture at toy size, for running a GPU benchmark on a CPU (--small of serve.py, latency.py and
# throughput.py; tests/test_benchmarks.py runs them so).
LLAMA_TINY = {**LLAMA_1B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "bos_token_id": 0,
              "eos_token_id": 1}


def random_llama(path: str, shape: dict, dtype: str = "bfloat16") -> str:
    """Saves (once) a random-weight LlamaForCausalLM of `shape` and returns its directory."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**shape)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    # Saved beside, then renamed into place: a run that starts meanwhile (tests run the --small benchmarks)
    # finds a whole checkpoint or none, never a config.json without its weights.
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
        torch.cuda.empty_cache()  # a server started next sizes its KV cache from the memory left free
    return path


def random_llama_1b(path: str = "/tmp/llama-1b-random") -> str:
    """The random-weight bf16 Llama-3.2-1B-shaped checkpoint of docs/benchmarks.md."""
    return random_llama(path, LLAMA_1B)


def random_llama_tiny(path: str = "/tmp/llama-tiny-random") -> str:
    """LLAMA_TINY in float32: the model of the GPU benchmarks' --small runs on a CPU."""
    return random_llama(path, LLAMA_TINY, "float32")


def cuda_ms(fn: Any, reps: int = 50) -> float:
    """Milliseconds of GPU time per call of fn (which only enqueues work), by CUDA events over `reps` calls
    after one warm-up call."""
    import torch

    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def attention_metadata(query_lens: list[int], context_lens: list[int], block_tables: Any) -> Any:
    """AttentionMetadata for a batch whose K/V are in the cache already (for timing or checking attention
    alone: slot_mapping is all zeros, as no op here stores K/V)."""
    import torch

    from tinyvllm.ops import AttentionMetadata

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


def commit() -> str:
    """The commit measured (TINYVLLM_COMMIT where the tree travelled without its .git)."""
    if os.environ.get("TINYVLLM_COMMIT"):
        return os.environ["TINYVLLM_COMMIT"]
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
