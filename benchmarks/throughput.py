"""throughput-256 and static-vs-continuous (shared/BENCHMARKS.md): nano-vllm's bench.py workload.

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
import time

from common import commit, gpu_name, random_llama_1b, random_llama_tiny

SPEED_OF_LIGHT = 70_700  # output tok/s, BENCHMARKS.md


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


def trace_steps(llm) -> list[tuple[int, int, float]]:
    """Wraps the engine so that each step records (sequences, tokens, seconds) of the batch whose outputs it
    returns (with async scheduling a step also launches the next batch: that one is not the step's); returns
    the list it fills."""
    engine = llm.llm_engine
    records: list[tuple[int, int, float]] = []
    process, step = engine._process, engine.step
    processed: list = [None]

    def traced_process(batch, pending):
        processed[0] = batch
        return process(batch, pending)

    def traced_step():
        start = time.perf_counter()
        processed[0] = None
        outputs = step()
        if processed[0] is not None:
            records.append((len(processed[0].seqs), processed[0].num_batched_tokens, time.perf_counter() - start))
        return outputs

    engine._process, engine.step = traced_process, traced_step
    return records


def summarize_trace(records: list[tuple[int, int, float]]) -> dict[str, float]:
    """Steps that only decode against steps that also prefill, and decode step time by batch size."""
    decode = [r for r in records if r[0] == r[1]]
    mixed = [r for r in records if r[0] != r[1]]
    summary = {"steps": len(records), "decode_steps": len(decode), "decode_s": sum(r[2] for r in decode),
               "mixed_steps": len(mixed), "mixed_s": sum(r[2] for r in mixed),
               "mixed_tokens": sum(r[1] for r in mixed)}
    for low, high in ((1, 64), (65, 128), (129, 192), (193, 256)):
        times = [r[2] for r in decode if low <= r[0] <= high]
        if times:
            summary[f"decode {low}-{high} ms/step"] = 1e3 * sum(times) / len(times)
            summary[f"decode {low}-{high} steps"] = len(times)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the random-weight Llama-3.2-1B shape")
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
    parser.add_argument("--max-num-seqs", type=int, default=256,
                        help="below the number of prompts, static batching waits on each batch's longest request")
    parser.add_argument("--trace", action="store_true", help="time every step: decode-only vs mixed, by batch")
    parser.add_argument("--repeat", type=int, default=1, help="run each scheduling policy this many times, "
                        "alternating (a fresh engine each time), to see the run-to-run spread")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    for name, large, small in (("num_prompts", 256, 16), ("peer_prompts", 64, 8), ("peer_max_tokens", 128, 8)):
        if getattr(args, name) is None:
            setattr(args, name, small if args.small else large)
    path = args.model or (random_llama_tiny() if args.small else random_llama_1b())
    device = "cpu" if args.small else "cuda"
    engine_kwargs = {"device": "cpu"} if args.small else {}

    import torch

    from tinyvllm import LLM
    from tinyvllm.entrypoints.bench_offline import run_throughput, throughput_workload

    if args.small:  # (prompt tokens within the tiny model's vocabulary)
        with open(os.path.join(path, "config.json")) as f:
            vocab_size = json.load(f)["vocab_size"]
        prompts, params = throughput_workload(args.num_prompts, 8, 64, 4, 32, vocab_size=vocab_size)
    else:
        prompts, params = throughput_workload(args.num_prompts)
    result = {"commit": commit(), "gpu": gpu_name(), "tensor_parallel_size": args.tensor_parallel_size}
    caching = "off" if args.no_prefix_caching else "on"
    tp = f", tensor_parallel_size {args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""
    print(f"throughput-{args.num_prompts} (max_num_seqs {args.max_num_seqs}, prefix caching {caching}{tp}) "
          f"on {result['gpu']} at {result['commit']}: "
          f"{sum(map(len, prompts))} prompt tokens, {sum(p.max_tokens for p in params)} output tokens")
    policies = ("continuous",) + (() if args.no_static else ("static",))
    for run, scheduling in enumerate(policies * args.repeat):
        name = scheduling if run < len(policies) else f"{scheduling} (run {run // len(policies) + 1})"
        llm = LLM(path, skip_tokenizer_init=True, scheduling=scheduling, enforce_eager=args.enforce_eager,
                  async_scheduling=not args.no_async_scheduling,
                  max_model_len=4096, max_num_seqs=args.max_num_seqs,
                  enable_prefix_caching=not args.no_prefix_caching, tensor_parallel_size=args.tensor_parallel_size,
                  **engine_kwargs)
        records = trace_steps(llm) if args.trace else None
        try:
            r = run_throughput(llm, prompts, params, on_start=records.clear if records is not None else None)
        finally:
            llm.llm_engine.shutdown()  # the tensor-parallel workers, before the next engine starts its own
        if records is not None:
            r["trace"] = summarize_trace(records)
            print("    steps:", ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                         for k, v in r["trace"].items()))
        r["num_kv_blocks"] = llm.llm_engine.engine_core.block_manager.num_blocks
        result.setdefault(scheduling, r)
        result.setdefault("runs", []).append({"scheduling": scheduling, **r})
        light = "" if args.small else (f", {r['output_tok_per_s'] / SPEED_OF_LIGHT:.0%} of the ~{SPEED_OF_LIGHT:,} "
                                       "tok/s speed of light")
        print(f"  tinyvllm {name}: {r['output_tok_per_s']:,.0f} output tok/s ({r['seconds']:.1f} s, "
              f"{r['preemptions']} preemptions){light}")
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
