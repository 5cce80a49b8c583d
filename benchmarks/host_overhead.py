"""The engine's own host time per decode step at a full batch, with the model's work taken away.

The forward pass, the LM head and the sampler's draw (device work on a GPU) of a tiny random Llama are
replaced by no-ops returning zeros, so a step's time is what the engine does in Python and numpy around the
model: scheduling, the model runner's inputs, the sampler's bookkeeping, taking the sampled tokens in, the
scheduler's update and the output processor. At 256 sequences these decide whether a GPU step is bound by the
host (benchmarks/throughput.py --trace shows it there). It also times the requests' way in (LLM.generate's
add_request calls: checking and queueing the prompts) and the steps that hold prompt tokens, which with
--prefix-len N share their first N tokens, as shared_prefix.py's do. Runs on the CPU; to compare two trees, run
it in each in the same session.

    python benchmarks/host_overhead.py [--num-seqs 256] [--temperature 0.6] [--prefix-len 1024] [--json FILE]"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch
from common import commit, random_llama_tiny


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prefix-len", type=int, default=0, help="tokens every prompt starts with (the prompt "
                        "length is this plus --prompt-len)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=3, help="runs; the median of each part over all of them")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from tinyvllm import LLM, SamplingParams

    llm = LLM(random_llama_tiny(), device="cpu", skip_tokenizer_init=True, max_num_seqs=args.num_seqs,
              max_num_batched_tokens=max(8192, args.num_seqs * args.prompt_len),
              max_model_len=max(1024, args.prefix_len + args.prompt_len + args.output_len),
              num_kv_blocks=args.num_seqs * (-(-(args.prompt_len + args.output_len) // 16) + 1)
              + 2 * (-(-args.prefix_len // 16)))
    engine = llm.llm_engine
    model = engine.engine_core.model_runner.model
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    model.forward = lambda ids, positions, meta: torch.zeros(ids.shape[0], hidden)
    model.compute_logits = lambda h: torch.zeros(h.shape[0], vocab)
    model.greedy_tokens = lambda h: torch.zeros(h.shape[0], dtype=torch.int64)
    # (and the sampler's draw, a kernel on the GPU: on the CPU its reference would dwarf everything else)
    engine.engine_core.model_runner.sampler.draw = lambda logits, sampling: torch.zeros(logits.shape[0],
                                                                                       dtype=torch.int64)

    steps = []
    engine.add_step_callback(steps.append)
    processing: list[float] = []
    process = engine.output_processor.process

    def timed_process(outputs):
        start = time.perf_counter()
        result = process(outputs)
        processing.append((time.perf_counter() - start) * 1e3)
        return result

    engine.output_processor.process = timed_process
    intake: list[float] = [0.0]  # each run's add_request calls, summed (the first: the warm-up's)
    add_request = engine.add_request

    def timed_add_request(*a, **kw):
        start = time.perf_counter()
        result = add_request(*a, **kw)
        intake[-1] += (time.perf_counter() - start) * 1e3
        return result

    engine.add_request = timed_add_request
    rng = random.Random(0)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True, seed=None)
    llm.generate([[rng.randrange(vocab) for _ in range(16)] for _ in range(8)],
                 SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    parts: dict[str, list[float]] = {"schedule": [], "launch": [], "read back": [], "update": [],
                                     "output processing": []}
    prompt_steps: list[float] = []  # each run's steps with prompt tokens: schedule + launch + update, summed
    for _ in range(args.repeats):
        steps.clear()
        processing.clear()
        intake.append(0.0)
        prefix = [rng.randrange(vocab) for _ in range(args.prefix_len)]
        prompts = [prefix + [rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.num_seqs)]
        llm.generate(prompts, params, use_tqdm=False)
        prompt_steps.append(sum(s.host_ms for s in steps if s.num_prefill_tokens))
        # (processing[i] is step i's; the decode steps at a full batch are the ones measured)
        for stats, processed in zip(steps, processing):
            if stats.num_prefill_tokens == 0 and stats.num_seqs == args.num_seqs:
                parts["schedule"].append(stats.schedule_ms)
                parts["launch"].append(stats.launch_ms)
                parts["read back"].append(stats.wait_ms)  # (nothing to wait for here: taking the tokens in)
                parts["update"].append(stats.update_ms)
                parts["output processing"].append(processed)
    medians = {name: statistics.median(values) for name, values in parts.items()}
    total = sum(medians.values())
    print(f"host time per decode step at {args.num_seqs} sequences, T={args.temperature} "
          f"(CPU, forward pass, LM head and draw free; commit {commit()}; {len(parts['launch'])} steps):")
    for name, value in medians.items():
        print(f"  {name:18s} {value:7.3f} ms")
    print(f"  {'total':18s} {total:7.3f} ms")
    print(f"requests in (add_request of {args.num_seqs} prompts of {args.prefix_len + args.prompt_len} tokens): "
          f"{statistics.median(intake[1:]):.2f} ms; steps with prompt tokens, host time summed: "
          f"{statistics.median(prompt_steps):.2f} ms (medians of {args.repeats} runs)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"commit": commit(), "num_seqs": args.num_seqs, "temperature": args.temperature,
                       "prefix_len": args.prefix_len, "ms": medians, "total_ms": total,
                       "requests_in_ms": statistics.median(intake[1:]),
                       "prompt_steps_host_ms": statistics.median(prompt_steps)}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
