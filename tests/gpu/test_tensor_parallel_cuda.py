"""Tensor parallelism on CUDA, on the Llama-3.2-1B-shaped random-weight model (bench_offline.LLAMA_1B): greedy
output (4 prompts x 32 tokens) with tensor_parallel_size=2, async scheduling off and on, must equal size 1's in
float32. In bfloat16 the all-reduce changes the rounding and near-ties of random weights may flip: identical
tokens pass, different ones are reported as xfail with the common prefix lengths, not judged.

With two or more GPUs, rank r runs on GPU r and the ranks talk NCCL. With one, both ranks share GPU 0 and talk
gloo (TINYVLLM_TP_ONE_GPU=1), so the shards, the Triton kernels on them, the broadcast of each step's device
buffer and async scheduling all run on the GPU; only NCCL does not. Each dtype runs in a fresh process
(TINYVLLM_TP_ONE_GPU is read when tinyvllm is imported, by it and by the ranks it spawns).

    python -m pytest -m cuda tests/gpu/test_tensor_parallel_cuda.py -ra      (on a GPU machine; skipped elsewhere)
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.utils import CUDA_ONLY, random_llama_1b, run_python

pytestmark = CUDA_ONLY

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = [[(i * 37 + j * 11) % 10000 for j in range(n)] for i, n in enumerate((5, 40, 130, 300))]
NUM_TOKENS = 32

# Size 1, then size 2 with async scheduling off and on, in one process. A fixed KV pool: two ranks sizing theirs
# from the free memory of one shared GPU would each count the other's as taken (and with a GPU each, the same
# pool keeps the runs alike). Prints RESULT and JSON {run: {tokens, seconds}}.
GENERATE = r"""
import json, sys, time
from tinyvllm import LLM, SamplingParams
path, dtype, prompts, num_tokens = json.loads(sys.argv[1])


def generate(size, async_scheduling):
    llm = LLM(path, skip_tokenizer_init=True, dtype=dtype, max_model_len=2048, num_kv_blocks=1024,
              max_num_seqs=16, tensor_parallel_size=size, async_scheduling=async_scheduling)
    try:
        params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
        start = time.perf_counter()
        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        return dict(tokens=tokens, seconds=time.perf_counter() - start)
    finally:
        llm.llm_engine.shutdown()


results = {"tp1": generate(1, False), "tp2 sync": generate(2, False), "tp2 async": generate(2, True)}
print("RESULT" + json.dumps(results))
"""


def one_gpu() -> bool:
    return torch.cuda.device_count() < 2


class TensorParallelRuns:
    """Each dtype's three runs once, in their own process, when a test first asks for them."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.results: dict[str, dict[str, Any] | str] = {}

    def get(self, dtype: str) -> dict[str, Any]:
        if dtype not in self.results:
            self.results[dtype] = self._run(dtype)
        result = self.results[dtype]
        if isinstance(result, str):
            pytest.fail(f"tensor-parallel runs ({dtype}) failed:\n{result}")
        return result

    def _run(self, dtype: str) -> dict[str, Any] | str:
        env = dict(os.environ)
        if one_gpu():
            env["TINYVLLM_TP_ONE_GPU"] = "1"
        return run_python(GENERATE, [self.path, dtype, PROMPTS, NUM_TOKENS], env, 800)


@pytest.fixture(scope="module")
def tp_runs() -> TensorParallelRuns:
    path = random_llama_1b()
    torch.cuda.empty_cache()
    return TensorParallelRuns(path)


def compare(runs: dict[str, Any], run: str, dtype: str) -> tuple[bool, str]:
    one, two = runs["tp1"]["tokens"], runs[run]["tokens"]
    assert len(two) == len(one) == len(PROMPTS), f"{run} ({dtype}): {len(two)} outputs, tp=1 {len(one)}"
    same = sum(a == b for a, b in zip(one, two))
    prefix = [next((i for i, (p, q) in enumerate(zip(a, b)) if p != q), len(a)) for a, b in zip(one, two)]
    how = "one GPU, gloo" if one_gpu() else "two GPUs, NCCL"
    return same == len(one), (f"tp=2 ({how}, {run.removeprefix('tp2 ')}) vs tp=1, {dtype}: identical "
                              f"{same}/{len(one)}, common prefix lengths {prefix} of {NUM_TOKENS} "
                              f"({runs[run]['seconds']:.1f} s for {len(PROMPTS)} x {NUM_TOKENS} tokens, eager)")


@pytest.mark.parametrize("run", ["tp2 sync", "tp2 async"])
def test_tensor_parallel_float32_equals_one_rank(tp_runs: TensorParallelRuns, run: str) -> None:
    same, detail = compare(tp_runs.get("float32"), run, "float32")
    assert same, detail


@pytest.mark.parametrize("run", ["tp2 sync", "tp2 async"])
def test_tensor_parallel_bfloat16_reported(tp_runs: TensorParallelRuns, run: str) -> None:
    """Reported, not judged: the all-reduce order changes bf16 rounding; near-ties of random weights may flip."""
    same, detail = compare(tp_runs.get("bfloat16"), run, "bfloat16")
    if not same:
        pytest.xfail(f"bf16 (a flip at a near-tie is expected): {detail}")
