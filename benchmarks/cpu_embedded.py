"""cpu-embedded (docs/benchmarks.md): SmolLM2-135M-Instruct on this CPU, batch 1 and batch 16,
64 generated tokens each, against transformers `generate` on the same GGUF in the same run and, when
llama-cpp-python is installed, llama.cpp on the same file at batch 1 (it decodes one sequence per context); and the
time to the batch's first tokens (one token each, the prompts' prefill: median of 3) against `generate` with one new
token. Each engine's resident memory after its load is printed (VmRSS growth; tinyvllm's, loaded first, counts
torch's import too).

llama.cpp: `pip install llama-cpp-python` builds it from source (~6 min on 2 cores). Its default native build may
crash on CPUs with AMX; `CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" pip install
llama-cpp-python` works there."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

from common import commit

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
             "Explain gravity to a child.", "What is 17 times 23?", "Name a famous painter.",
             "Why is the sky blue?", "Give me a synonym for happy.", "What does a CPU do?",
             "Translate 'good morning' to Spanish.", "How many legs does a spider have?",
             "What is photosynthesis?", "Suggest a name for a cat.", "What is the boiling point of water?",
             "Who wrote Hamlet?", "Describe a rainbow in one sentence."]


def median_seconds(run: Callable[..., object], *args: object, **kwargs: object) -> float:
    """The median wall time of three calls of run(*args, **kwargs)."""
    timings = []
    for _ in range(3):
        start = time.perf_counter()
        run(*args, **kwargs)
        timings.append(time.perf_counter() - start)
    return statistics.median(timings)


def rss_mib() -> float:
    """This process's resident memory (VmRSS), MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def llama_cpp_tok_s(path: str, prompt: list[int], tokens: int) -> tuple[float, float] | None:
    """(llama.cpp's batch-1 greedy decode tok/s of `tokens` tokens after `prompt`, the MiB its load added), or None
    when llama-cpp-python is not installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    import torch

    before = rss_mib()
    llm = Llama(path, n_ctx=len(prompt) + tokens + 8, n_threads=torch.get_num_threads(), verbose=False)
    loaded = rss_mib() - before

    def decode() -> float:
        llm.reset()
        start, n = time.perf_counter(), 0
        for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            n += 1
            if n == tokens:
                break
        return n / (time.perf_counter() - start)

    decode()
    return statistics.median(decode() for _ in range(3)), loaded


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", default="1,16")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from tinyvllm import LLM, SamplingParams
    from tinyvllm.model.loader import embedded_model_path

    start = time.perf_counter()
    llm = LLM(device="cpu")
    load_s, our_rss = time.perf_counter() - start, rss_mib()
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    path = embedded_model_path()
    before = rss_mib()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    their_rss = rss_mib() - before
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    print(f"cpu-embedded at {commit()}: SmolLM2-135M-Instruct (GGUF weights kept quantized, bfloat16 activations "
          f"in their products), {args.tokens} tokens, {torch.get_num_threads()} threads")
    print(f"  load {load_s:.1f} s; resident after load: tinyvllm {our_rss:.0f} MiB (torch included), transformers "
          f"+{their_rss:.0f} MiB")
    cpp = llama_cpp_tok_s(path, prompts[0], args.tokens)
    if cpp is None:
        print("  llama.cpp: not installed (pip install llama-cpp-python: a ~6 min build from source)")
    else:
        print(f"  llama.cpp batch  1: {cpp[0]:7.1f} tok/s, its load +{cpp[1]:.0f} MiB")
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        batch = prompts[:bs]
        start = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        ours = sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)

        width = max(map(len, batch))
        ids = torch.tensor([[2] * (width - len(p)) + p for p in batch])  # left padding, as generate wants
        mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in batch])[:, None]).long()
        with torch.inference_mode():
            hf.generate(ids[:, -8:], attention_mask=mask[:, -8:], max_new_tokens=2, do_sample=False, pad_token_id=2)
            start = time.perf_counter()
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                              do_sample=False, pad_token_id=2)
            theirs = (out.shape[1] - width) * bs / (time.perf_counter() - start)
            their_first = median_seconds(hf.generate, ids, attention_mask=mask, max_new_tokens=1, do_sample=False,
                                         pad_token_id=2)
        our_first = median_seconds(llm.generate, batch, first, use_tqdm=False)
        against_cpp = f", {ours / cpp[0]:.2f}x llama.cpp" if cpp is not None and bs == 1 else ""
        print(f"  batch {bs:>2}: tinyvllm {ours:7.1f} tok/s, transformers {theirs:7.1f} tok/s, "
              f"ratio {ours / theirs:.2f}x{against_cpp}; first tokens {our_first * 1e3:.0f} against "
              f"{their_first * 1e3:.0f} ms, {their_first / our_first:.2f}x")


if __name__ == "__main__":
    main()
