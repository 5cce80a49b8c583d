"""throughput-256 and static-vs-continuous (docs/benchmarks.md): nano-vllm's bench.py workload.

Ours (continuous and static scheduling) against transformers' continuous batching `generate_batch`
on the same model in the same run (on a shorter workload, said in the output: it is ~30x slower).

    python benchmarks/throughput.py [--json FILE]    (H200: the random-weight Llama-3.2-1B shape)
    python benchmarks/throughput.py --small          (CPU: a tiny random Llama, 16 prompts of 8 to 64 tokens, 4 to
                                                     32 output tokens; its figures mean nothing, it shows that the
                                                     script runs)"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

from common import SHAPES, GcWatch, commit, gpu_name, random_llama_tiny, random_shape, require_gpu

SPEED_OF_LIGHT = 70_700  # output tok/s, docs/benchmarks.md


def hf_throughput(path: str, prompts: list[list[int]], max_new_tokens: int,
                  device: str = "cuda") -> dict[str, float]:
    """transformers' continuous batching: bf16 on a GPU, float32 (as the engine runs) on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="paged|sdpa")
    model = model.to(device).eval()
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    kwargs = {}
    if device == "cpu":  # there transformers would size its KV cache at 90% of the machine's RAM, and zero it
        from transformers import ContinuousBatchingConfig

        kwargs["continuous_batching_config"] = ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=1024)
    model.generate_batch(inputs=prompts[:2], generation_config=config, **kwargs)  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    results = model.generate_batch(inputs=prompts, generation_config=config, **kwargs)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    generated = sum(len(r.generated_tokens) for r in results.values())
    return {"output_tokens": generated, "seconds": seconds, "output_tok_per_s": generated / seconds}


def summarize_trace(records: list, max_num_seqs: int = 256) -> dict[str, float]:
    """Steps that only decode against steps that also prefill, and the decode steps by batch size (in bands
    of 64 sequences): per step, the wall clock, the host's own time (schedule + launch + update) and, where
    recorded, the GPU's (CUDA events). `records`: StepRecorder.steps(), (StepStats, wall period in seconds)."""

    def figures(name: str, group: list) -> dict[str, float]:
        out = {f"{name} steps": len(group), f"{name} s": sum(seconds for _, seconds in group)}
        if group:
            out[f"{name} ms/step"] = 1e3 * out[f"{name} s"] / len(group)
            out[f"{name} host ms/step"] = sum(s.host_ms for s, _ in group) / len(group)
            for phase in ("schedule", "launch", "update", "wait"):
                out[f"{name} {phase} ms/step"] = sum(getattr(s, f"{phase}_ms") for s, _ in group) / len(group)
            gpu = [s.gpu_ms for s, _ in group if s.gpu_ms is not None]
            if gpu:
                out[f"{name} GPU ms/step"] = sum(gpu) / len(gpu)
        return out

    decode = [r for r in records if r[0].num_prefill_tokens == 0]
    mixed = [r for r in records if r[0].num_prefill_tokens > 0]
    summary = {"steps": len(records), **figures("decode", decode), **figures("mixed", mixed),
               "mixed prefill tokens": sum(s.num_prefill_tokens for s, _ in mixed),
               "mixed decode tokens": sum(s.num_decode_tokens for s, _ in mixed)}
    for low in range(1, max_num_seqs + 1, 64):
        high = min(low + 63, max_num_seqs)
        band = [r for r in decode if low <= r[0].num_seqs <= high]
        if band:
            summary.update(figures(f"decode {low}-{high}", band))
    return summary


def print_trace(summary: dict[str, float]) -> None:
    timed = ", GPU (CUDA events)" if any(k.endswith(" GPU ms/step") for k in summary) else ""
    print(f"    {summary['steps']} steps; per step: wall clock, the step's own host time (schedule + launch + update)"
          f"{timed}")
    bands = [k[: -len(" steps")] for k in summary if re.fullmatch(r"decode \d+-\d+ steps", k)]
    for name in ["mixed", "decode", *bands]:
        n = summary[f"{name} steps"]
        if not n:
            continue
        gpu = summary.get(f"{name} GPU ms/step")
        line = (f"      {name + ':':<16} {n:6} steps, {summary[f'{name} s']:7.3f} s, "
                f"{summary[f'{name} ms/step']:7.3f} ms wall, {summary[f'{name} host ms/step']:7.3f} ms host"
                + ("" if gpu is None else f", {gpu:7.3f} ms GPU"))
        if name == "mixed":
            line += f" ({summary['mixed prefill tokens']} prefill + {summary['mixed decode tokens']} decode tokens)"
        print(line)
        if name == "mixed":  # (where a prompt step's host time goes)
            print(" " * 8 + "host: " + ", ".join(f"{phase} {summary[f'mixed {phase} ms/step']:.3f}"
                                                   for phase in ("schedule", "launch", "update"))
                  + f" ms; waiting for its tokens {summary['mixed wait ms/step']:.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the random-weight model of --shape")
    parser.add_argument("--shape", default="llama-1b", choices=tuple(SHAPES),
                        help="the random-weight model's shape (default: Llama-3.2-1B's)")
    parser.add_argument("--small", action="store_true",
                        help="CPU-sized: a tiny random Llama and workload, ours and the transformers peer on the CPU")
    parser.add_argument("--num-prompts", type=int, default=None, help="default 256; --small: 16")
    parser.add_argument("--peer-prompts", type=int, default=None, help="default 64; --small: 8")
    parser.add_argument("--peer-max-tokens", type=int, default=None, help="default 128; --small: 8")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--no-static", action="store_true")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--no-async-scheduling", action="store_true", help="launch each step after the last ends")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks, one GPU each (issue 7)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="auto (the model's dtype) or fp8 (float8 e4m3, sm_89+: twice the blocks of bf16)")
    parser.add_argument("--quantization", default=None, choices=("fp8",), help="the weights' format (default: bf16)")
    parser.add_argument("--block-size", type=int, help="tokens per KV-cache block (default: the engine's)")
    parser.add_argument("--max-num-seqs", type=int, default=256,
                        help="below the number of prompts, static batching waits on each batch's longest request")
    parser.add_argument("--trace", action="store_true",
                        help="time every step (wall clock, host, GPU): decode-only vs mixed, by batch size")
    parser.add_argument("--plot", default=None, metavar="FILE",
                        help="draw each run's steps into a PNG (several runs: FILE-continuous.png, "
                        "FILE-static.png, ...; needs matplotlib)")
    parser.add_argument("--repeat", type=int, default=1, help="run each scheduling policy this many times, "
                        "alternating (a fresh engine each time), to see the run-to-run spread")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    require_gpu(parser, args.small)
    from tinyvllm.entrypoints.step_plot import StepRecorder, import_matplotlib, plot_path, plot_steps

    if args.plot:
        try:
            import_matplotlib()  # before the runs, not after them
        except ImportError as e:
            parser.error(str(e))
    for name, large, small in (("num_prompts", 256, 16), ("peer_prompts", 64, 8), ("peer_max_tokens", 128, 8)):
        if getattr(args, name) is None:
            setattr(args, name, small if args.small else large)
    path = args.model or (random_llama_tiny() if args.small else random_shape(args.shape))
    device = "cpu" if args.small else "cuda"
    engine_kwargs = {"kv_cache_dtype": args.kv_cache_dtype, "quantization": args.quantization,
                     **({"device": "cpu"} if args.small else {}),
                     **({"block_size": args.block_size} if args.block_size else {})}

    import torch

    from tinyvllm import LLM
    from tinyvllm.entrypoints.bench_offline import run_throughput, throughput_workload

    if args.small:  # (prompt tokens within the tiny model's vocabulary)
        with open(os.path.join(path, "config.json")) as f:
            vocab_size = json.load(f)["vocab_size"]
        prompts, params = throughput_workload(args.num_prompts, 8, 64, 4, 32, vocab_size=vocab_size)
    else:
        prompts, params = throughput_workload(args.num_prompts)
    result = {"commit": commit(), "gpu": gpu_name(), "tensor_parallel_size": args.tensor_parallel_size,
              "kv_cache_dtype": args.kv_cache_dtype, "quantization": args.quantization}
    caching = "off" if args.no_prefix_caching else "on"
    tp = f", tensor_parallel_size {args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""
    tp += f", kv_cache_dtype {args.kv_cache_dtype}" if args.kv_cache_dtype != "auto" else ""
    tp += f", quantization {args.quantization}" if args.quantization else ""
    tp += f", block_size {args.block_size}" if args.block_size else ""
    print(f"throughput-{args.num_prompts} (max_num_seqs {args.max_num_seqs}, prefix caching {caching}{tp}) "
          f"on {result['gpu']} at {result['commit']}: "
          f"{sum(map(len, prompts))} prompt tokens, {sum(p.max_tokens for p in params)} output tokens")
    policies = ("continuous",) + (() if args.no_static else ("static",))
    runs = policies * args.repeat
    for run, scheduling in enumerate(runs):
        name = scheduling if run < len(policies) else f"{scheduling} (run {run // len(policies) + 1})"
        llm = LLM(path, skip_tokenizer_init=True, scheduling=scheduling, enforce_eager=args.enforce_eager,
                  async_scheduling=not args.no_async_scheduling,
                  max_model_len=4096, max_num_seqs=args.max_num_seqs,
                  enable_prefix_caching=not args.no_prefix_caching, tensor_parallel_size=args.tensor_parallel_size,
                  **engine_kwargs)
        recorder = StepRecorder.attach(llm) if args.trace or args.plot else None
        try:
            with GcWatch() as gc_watch:  # (the warm-up's collections too: it is short)
                r = run_throughput(llm, prompts, params, on_start=recorder.clear if recorder is not None else None)
        finally:
            llm.llm_engine.shutdown()  # the tensor-parallel workers, before the next engine starts its own
        if args.trace:
            r["trace"] = summarize_trace(recorder.steps(), args.max_num_seqs)
        r["num_kv_blocks"] = llm.llm_engine.get_stats()["num_blocks"]
        result.setdefault(scheduling, r)
        result.setdefault("runs", []).append({"scheduling": scheduling, **r})
        light = "" if args.small or args.model or args.shape != "llama-1b" else (
            f", {r['output_tok_per_s'] / SPEED_OF_LIGHT:.0%} of the ~{SPEED_OF_LIGHT:,} tok/s speed of light")
        print(f"  tinyvllm {name}: {r['output_tok_per_s']:,.0f} output tok/s ({r['seconds']:.1f} s, "
              f"{r['preemptions']} preemptions){light}; {gc_watch}")
        if args.trace:
            print_trace(r["trace"])
        if args.plot:
            plot = plot_path(args.plot, name, only=len(runs) == 1)
            plot_steps(recorder.records, plot, f"throughput-{args.num_prompts}, {name}: "
                       f"{r['output_tok_per_s']:,.0f} output tok/s\n{result['gpu']} at {result['commit']}, "
                       f"max_num_seqs {args.max_num_seqs}, prefix caching {caching}{tp}", start=recorder.start)
            print(f"    steps drawn in {plot}")
        del llm
        torch.cuda.empty_cache()
    if "static" in result:
        import statistics

        def median(policy: str) -> float:
            return statistics.median(r["output_tok_per_s"] for r in result["runs"] if r["scheduling"] == policy)

        ratio = median("continuous") / median("static")
        note = f" (medians of {args.repeat} runs each)" if args.repeat > 1 else ""
        print(f"  continuous / static: {ratio:.2f}x{note}")
    if not args.no_peer:
        short = prompts[: args.peer_prompts]
        try:
            peer = hf_throughput(path, short, args.peer_max_tokens, device)
            result["transformers_generate_batch"] = peer
            llm = LLM(path, skip_tokenizer_init=True, max_model_len=4096, **engine_kwargs)
            same = run_throughput(llm, short, [type(params[0])(temperature=0, ignore_eos=True,
                                                              max_tokens=args.peer_max_tokens)] * len(short))
            result["ours_on_peer_workload"] = same
            print(f"  on a shorter workload ({len(short)} prompts, {args.peer_max_tokens} tokens each, greedy): "
                  f"transformers generate_batch {peer['output_tok_per_s']:,.0f} tok/s, tinyvllm "
                  f"{same['output_tok_per_s']:,.0f} tok/s: {same['output_tok_per_s'] / peer['output_tok_per_s']:.1f}x")
        except Exception as e:
            print(f"  transformers generate_batch failed: {type(e).__name__}: {e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
