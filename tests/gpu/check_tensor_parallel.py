"""Tensor parallelism on CUDA (`python tests/gpu/check_tensor_parallel.py`). Greedy output with
tensor_parallel_size=2 must equal size 1 in float32 (bf16 is reported). Exits non-zero on a failure.
Arguments: the dtypes to run (default float32 and bfloat16).

With two or more GPUs, rank r runs on GPU r and the ranks talk NCCL. With one, both ranks share GPU 0 and talk
gloo (TINYVLLM_TP_ONE_GPU=1), so the shards, the Triton kernels on them, the broadcast of each step's device
buffer and async scheduling all run on the GPU; only NCCL does not."""

from __future__ import annotations

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import torch  # noqa: E402

ONE_GPU = torch.cuda.device_count() < 2
if ONE_GPU:
    os.environ["TINYVLLM_TP_ONE_GPU"] = "1"  # before tinyvllm is imported (here and in the spawned ranks)

PROMPTS = [[(i * 37 + j * 11) % 10000 for j in range(n)] for i, n in enumerate((5, 40, 130, 300))]


def generate(path: str, dtype: str, size: int, async_scheduling: bool) -> tuple[list[list[int]], float]:
    from tinyvllm import LLM, SamplingParams

    # A fixed KV pool: two ranks sizing theirs from the free memory of one shared GPU would each count the
    # other's as taken (and with a GPU each, the same pool keeps the runs alike).
    llm = LLM(path, skip_tokenizer_init=True, dtype=dtype, max_model_len=2048, num_kv_blocks=1024,
              max_num_seqs=16, tensor_parallel_size=size, async_scheduling=async_scheduling)
    try:
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        start = time.perf_counter()
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        return tokens, time.perf_counter() - start
    finally:
        llm.llm_engine.shutdown()


def main() -> int:
    from common import random_llama_1b

    path = random_llama_1b()
    failed = 0
    for dtype in sys.argv[1:] or ("float32", "bfloat16"):
        one, _ = generate(path, dtype, 1, False)
        for async_scheduling in (False, True):
            two, seconds = generate(path, dtype, 2, async_scheduling)
            same = sum(a == b for a, b in zip(one, two))
            prefix = [next((i for i, (p, q) in enumerate(zip(a, b)) if p != q), len(a)) for a, b in zip(one, two)]
            how = "one GPU, gloo" if ONE_GPU else "two GPUs, NCCL"
            detail = (f"tp=2 ({how}, async {async_scheduling}) vs tp=1, {dtype}: identical {same}/{len(one)}, "
                      f"common prefix lengths {prefix} ({seconds:.1f} s for 4 x 32 tokens, eager)")
            if dtype == "float32":
                ok = same == len(one)
                failed += not ok
                print(f"{'PASS' if ok else 'FAIL'}  {detail}")
            else:  # all-reduce order changes bf16 rounding; near-ties of random weights may flip: reported
                print(f"INFO  {detail}")
    print("FAILED" if failed else "all passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
