"""latency-b1 (shared/BENCHMARKS.md): batch 1, 128-token prompt, 256 greedy tokens, ignore_eos.

Ours against transformers on the same model in the same run: `generate` with a static cache (its
decode step compiled, CUDA graphs) after a warm-up, and eager `generate` on a shorter run.

    python benchmarks/latency.py [--json FILE]     (H200: the random-weight Llama-3.2-1B shape)
    python benchmarks/latency.py --small           (CPU: a tiny random Llama, 16 prompt and 8 output tokens; its
                                                    figures mean nothing, it shows that the script runs)"""

from __future__ import annotations

import argparse
import json
import time

from common import commit, cuda_ms, gpu_name, random_llama_1b, random_llama_tiny

FLOOR_MS = 0.594  # batch-1 decode floor for the 1B model: weights / copy bandwidth (BENCHMARKS.md)


def hf_latency(path: str, prompt: list[int], output_len: int, static: bool,
               device: str = "cuda") -> dict[str, float]:
    """transformers `generate` at batch 1: bf16 on a GPU, float32 (as the engine runs) on the CPU, where
    transformers compiles nothing."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    ids = torch.tensor([prompt], device=device)
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    if static:
        kwargs["cache_implementation"] = "static"

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def timed(n: int) -> float:
        sync()
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
        sync()
        assert out.shape[1] == len(prompt) + n
        return time.perf_counter() - t

    timed(output_len if static else 4)  # warm-up (compiles the static-cache decode step)
    ttft = timed(1)
    total = timed(output_len)
    return {"ttft_ms": ttft * 1e3, "tpot_ms": (total - ttft) / (output_len - 1) * 1e3}


def step_breakdown(llm, prompt_len: int, output_len: int) -> dict[str, float]:
    """Where a decode step's time goes: host time in each phase of LLMEngine.step (wrapped timers), and
    the GPU time of one decode graph replay and of the LM head + the sampler's greedy path (CUDA events).
    With async scheduling the phases of two steps interleave: a step launches the next batch, then waits for its
    own tokens, so 'wait for the tokens' is the GPU time the host could not hide."""

    import torch

    from tinyvllm import SamplingParams
    from tinyvllm.worker.sampler import AsyncSamplerOutput, SamplingTensors

    engine = llm.llm_engine
    runner = engine.engine_core.model_runner
    totals: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                totals[name] = totals.get(name, 0.0) + time.perf_counter() - t
        return wrapper

    patched = [(engine.engine_core.scheduler, "schedule", "schedule"),
               (runner, "prepare", "prepare (host arrays -> one copy to the device)"),
               (runner, "execute", "launch (prepare + graph replay + LM head + sampler)"),
               (AsyncSamplerOutput, "get", "wait for the tokens (GPU time not hidden)"),
               (engine.engine_core.scheduler, "update", "scheduler update")]
    originals = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patched]
    for obj, attr, name in patched:
        setattr(obj, attr, timed(name, getattr(obj, attr)))
    prompt = [(100 + i) % engine.model_config.vocab_size for i in range(prompt_len)]  # (--small: 512 tokens)
    engine.add_request("breakdown", prompt, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    steps = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    wall = time.perf_counter() - t0
    for obj, attr, original in originals:
        setattr(obj, attr, original)
    result = {name: v / steps * 1e3 for name, v in totals.items()}
    result["whole step"] = wall / steps * 1e3
    if runner.graphs:
        result["GPU: decode graph replay (16 layers)"] = cuda_ms(runner.graphs[1].replay, 100)
        hidden = runner.graph_outputs[:1]
        greedy = SamplingTensors.greedy()
        with torch.inference_mode():  # the engine's tensors are inference tensors
            result["GPU: LM head + greedy sampler"] = cuda_ms(
                lambda: runner.sampler(runner.model.compute_logits(hidden), [], greedy), 100)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the random-weight Llama-3.2-1B shape")
    parser.add_argument("--small", action="store_true",
                        help="CPU-sized: a tiny random Llama, ours and the transformers peer on the CPU")
    parser.add_argument("--prompt-len", type=int, default=None, help="default 128; --small: 16")
    parser.add_argument("--output-len", type=int, default=None, help="default 256; --small: 8")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--no-async-scheduling", action="store_true", help="launch each step after the last ends")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks, one GPU each (issue 7)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    for name, large, small in (("prompt_len", 128, 16), ("output_len", 256, 8)):
        if getattr(args, name) is None:
            setattr(args, name, small if args.small else large)
    if args.output_len < 2:
        parser.error("--output-len must be at least 2 (time per output token is measured after the first)")
    path = args.model or (random_llama_tiny() if args.small else random_llama_1b())
    device = "cpu" if args.small else "cuda"

    from tinyvllm import LLM
    from tinyvllm.entrypoints.bench_offline import run_latency

    llm = LLM(path, skip_tokenizer_init=True, enforce_eager=args.enforce_eager, max_model_len=4096,
              gpu_memory_utilization=0.5, async_scheduling=not args.no_async_scheduling,
              tensor_parallel_size=args.tensor_parallel_size, **({"device": "cpu"} if args.small else {}))
    try:
        ours = run_latency(llm, args.prompt_len, args.output_len)
        breakdown = step_breakdown(llm, args.prompt_len, args.output_len)
    finally:
        llm.llm_engine.shutdown()  # the tensor-parallel workers, before the peer needs the GPU
    vocab_size = llm.llm_engine.model_config.vocab_size
    prompt = [(1000 + i) % vocab_size for i in range(args.prompt_len)]  # (the 1B's: 1000, 1001, ...)
    del llm
    result = {"commit": commit(), "gpu": gpu_name(), "ours": ours, "step_breakdown_ms": breakdown,
              "tensor_parallel_size": args.tensor_parallel_size}
    print(f"latency-b1 on {result['gpu']} at {result['commit']} ({args.prompt_len} prompt, {args.output_len} output)")
    mode = ", ".join(m for m, on in (("eager", args.enforce_eager), ("sync", args.no_async_scheduling),
                                     (f"tensor_parallel_size {args.tensor_parallel_size}",
                                      args.tensor_parallel_size > 1)) if on)
    floor = "" if args.small else f", {FLOOR_MS / ours['tpot_ms_median']:.0%} of the {FLOOR_MS} ms bandwidth floor"
    print(f"  tinyvllm{f' ({mode})' if mode else ''}: TTFT {ours['ttft_ms']:.2f} ms, "
          f"TPOT median {ours['tpot_ms_median']:.3f} ms ({ours['tok_per_s']:.0f} tok/s){floor}")
    print("  where a decode step's time goes (ms per step; with async scheduling launch and wait interleave):")
    for name, ms in breakdown.items():
        print(f"    {name:<42} {ms:7.3f}")
    if not args.no_peer:
        compiled = "" if args.small else " (compiled)"  # (transformers compiles on a GPU only)
        for name, static, n in ((f"transformers static cache{compiled}", True, args.output_len),
                                ("transformers eager", False, min(32, args.output_len))):
            try:
                peer = hf_latency(path, prompt, n, static, device)
            except Exception as e:  # report, do not hide, a peer that fails
                print(f"  {name}: failed: {type(e).__name__}: {e}")
                continue
            result[name] = peer
            print(f"  {name}: TTFT {peer['ttft_ms']:.2f} ms, TPOT {peer['tpot_ms']:.3f} ms "
                  f"({1e3 / peer['tpot_ms']:.0f} tok/s{'' if n == args.output_len else f', {n} tokens'}); "
                  f"tinyvllm is {peer['tpot_ms'] / ours['tpot_ms_median']:.1f}x faster per token")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
