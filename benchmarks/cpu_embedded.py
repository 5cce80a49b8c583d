"""cpu-embedded (docs/benchmarks.md): SmolLM2-135M-Instruct on this CPU, batch 1 and batch 16,
64 generated tokens each, against transformers `generate` on the same GGUF in the same run; and the time to the
batch's first tokens (one token each, the prompts' prefill: median of 3) against `generate` with one new token."""

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", default="1,16")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from tinyvllm import LLM, SamplingParams
    from tinyvllm.model.loader import embedded_model_path

    llm = LLM(device="cpu")
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    path = embedded_model_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    print(f"cpu-embedded at {commit()}: SmolLM2-135M-Instruct fp32, {args.tokens} tokens, "
          f"{torch.get_num_threads()} threads")
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
        print(f"  batch {bs:>2}: tinyvllm {ours:7.1f} tok/s, transformers {theirs:7.1f} tok/s, "
              f"ratio {ours / theirs:.2f}x; first tokens {our_first * 1e3:.0f} against {their_first * 1e3:.0f} ms, "
              f"{their_first / our_first:.2f}x")


if __name__ == "__main__":
    main()
