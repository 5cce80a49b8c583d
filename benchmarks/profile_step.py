"""Where a decode step's GPU time goes, on the Llama-3.2-1B-shaped random-weight model (H200).

1. The matrix products at decode sizes, each through cuBLAS in the ways torch can call it: F.linear on the
   [out, in] weight (what the model does), torch.matmul on an [in, out] copy, each with cuBLAS and with
   cuBLASLt preferred. Sixteen distinct weights per shape, replayed in a CUDA graph, as the 16 layers are,
   so that nothing is served from L2. Figures: microseconds per product and GB/s of weight read.
2. The kernels of one eager decode step at batch 1 and 256 (torch.profiler, GPU time of each kernel),
   against the same step replayed as a CUDA graph (CUDA events): the difference is the time between
   kernels.
3. The GPU's timeline over real engine steps (CUDA graphs, async scheduling, greedy) at batch 1: each step's
   period split into the graph's kernels, the work launched outside the graph (input copies, LM head,
   sampler, the tokens' copy to the host), and time the GPU sat idle, with what each idle gap preceded.
4. With --prompt N: the kernels of one sequence's N-token prompt step, eager (torch.profiler, GPU time of each
   kernel), the products at M = N, and a trace of lone requests through the engine's graphs split into the
   host's time before the GPU starts, the GPU's, and the wait for the token: what a request's time to first
   token waits for.

    python benchmarks/profile_step.py [--json PATH] [--timeline-only] [--prompt N [--prompt-only]]
5. With --knockout: what each small op costs inside a decode step's CUDA graph. The engine is built again with one
   op of the model swapped for a no-op before it captures its graphs (the outputs are then meaningless; only the
   replay's time is used), and its graph that ends in hidden states is replayed against the one with every op. Eager
   kernel sums (part 2) count a PDL kernel's wait for the kernel before as its own time; this does not.

    python benchmarks/profile_step.py --steps-only [--batches 256] [--kv-cache-dtype fp8]   (part 2 alone)
    python benchmarks/profile_step.py --knockout [--batches 256,32] [--kv-cache-dtype fp8]  (part 5 alone)
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

from common import commit, cuda_ms, gpu_name, random_llama_1b, require_gpu

LAYER_SHAPES = {"qkv_proj": (3072, 2048), "o_proj": (2048, 2048), "gate_up_proj": (16384, 2048),
                "down_proj": (2048, 8192), "lm_head": (128256, 2048)}


def graph_time_ms(fn, reps: int = 20) -> float:
    """GPU milliseconds of fn captured as a CUDA graph and replayed."""
    import torch

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return cuda_ms(graph.replay, reps)


def bench_matmuls(batches: list[int]) -> list[dict]:
    import torch
    import torch.nn.functional as F

    rows = []
    for name, (out_f, in_f) in LAYER_SHAPES.items():
        copies = 4 if name == "lm_head" else 16
        weights = [torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        weights_t = [w.t().contiguous() for w in weights]
        for m in batches:
            x = torch.randn(m, in_f, device="cuda", dtype=torch.bfloat16)
            result = {"shape": name, "M": m, "N": out_f, "K": in_f}
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                variants = {"linear[out,in]": lambda x=x, ws=weights: [F.linear(x, w) for w in ws],
                            "matmul[in,out]": lambda x=x, ws=weights_t: [torch.matmul(x, w) for w in ws]}
                for variant, fn in variants.items():
                    us = graph_time_ms(fn) / copies * 1e3
                    result[f"{variant} {lib} us"] = us
                    result[f"{variant} {lib} GB/s"] = out_f * in_f * 2 / us / 1e3
            torch.backends.cuda.preferred_blas_library("cublas")
            rows.append(result)
            best = min((k for k in result if k.endswith(" us")), key=lambda k: result[k])
            print(f"  {name:<13} M={m:<4} " + "  ".join(
                f"{k[:-3]}: {result[k]:7.1f} us ({result[k[:-3] + ' GB/s']:5.0f} GB/s)"
                for k in result if k.endswith(" us")) + f"   best: {best[:-3]}", flush=True)
        del weights, weights_t
        torch.cuda.empty_cache()
    return rows


def decoding_llm(path: str, batch: int, context: int, temperature: float = 0.6, **engine_args):
    """An engine with `batch` sequences of `context` prompt tokens, all decoding: stepped until each request's
    output (LLMEngine.step's RequestOutputs) has two tokens, one from its prefill and one from a decode step."""
    from tinyvllm import LLM, SamplingParams

    llm = LLM(path, skip_tokenizer_init=True, max_model_len=4096, max_num_seqs=max(batch, 1),
              gpu_memory_utilization=0.5, **engine_args)
    engine = llm.llm_engine
    for i in range(batch):
        engine.add_request(str(i), [(7 * i + j) % 10000 for j in range(context)],
                           SamplingParams(temperature=temperature, max_tokens=64, ignore_eos=True))
    num_outputs = dict.fromkeys(map(str, range(batch)), 0)
    while min(num_outputs.values(), default=2) < 2:
        for output in engine.step():
            num_outputs[output.request_id] = len(output.outputs[0].token_ids)
    return llm


def kernel_breakdown(path: str, batch: int, context: int, **engine_args) -> dict:
    """Per-kernel GPU time of one eager decode step at `batch` sequences of `context` tokens."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    llm = decoding_llm(path, batch, context, enforce_eager=True, **engine_args)
    engine = llm.llm_engine
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    steps = 5
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    del llm, engine
    torch.cuda.empty_cache()
    table = kernel_table(prof, steps, f"eager decode step, batch {batch}, context ~{context}", top=12)
    return {"batch": batch, "context": context, **table}


def kernel_table(prof, reps: int, title: str, top: int) -> dict:
    """A torch.profiler run of `reps` repeats of some work: its GPU time per repeat by kernel and by kernel family
    (_group), printed under `title` (the `top` longest kernels by name) and returned."""
    import torch

    per_kernel: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name] += event.time_range.elapsed_us() / reps
    total = sum(per_kernel.values())
    groups: dict[str, float] = defaultdict(float)
    for name, us in per_kernel.items():
        groups[_group(name)] += us
    print(f"\n  {title}: GPU kernel time {total / 1e3:.3f} ms")
    for group, us in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"    {group:<28} {us:8.1f} us  {us / total:5.1%}")
    print("    top kernels:")
    for name, us in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]:
        print(f"      {us:8.1f} us  {name[:110]}")
    return {"gpu_kernel_us": total, "groups_us": dict(groups), "kernels_us": dict(per_kernel)}


def prompt_breakdown(path: str, prompt_len: int, reps: int = 10) -> dict:
    """Per-kernel GPU time of one sequence's `prompt_len`-token prompt step (eager, async scheduling off: no
    lookahead step runs beside it, so the kernels are the prompt's, its LM head and its sampler's)."""
    import random

    import torch
    from torch.profiler import ProfilerActivity, profile

    from tinyvllm import LLM, SamplingParams

    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm = LLM(path, skip_tokenizer_init=True, max_model_len=4096, max_num_seqs=8, gpu_memory_utilization=0.5,
              enforce_eager=True, async_scheduling=False)
    prompts = [[[rng.randrange(10000) for _ in range(prompt_len)]] for _ in range(reps + 3)]
    for prompt in prompts[:3]:
        llm.generate(prompt, params, use_tqdm=False)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for prompt in prompts[3:]:
            llm.generate(prompt, params, use_tqdm=False)
        torch.cuda.synchronize()
    del llm
    torch.cuda.empty_cache()
    return {"prompt_len": prompt_len,
            **kernel_table(prof, reps, f"eager prompt step, one sequence of {prompt_len} tokens", top=14)}


def trace_events(prof) -> list[dict]:
    """A torch.profiler run's events as its Chrome trace has them (with the runtime calls' correlation ids)."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            return json.load(f)["traceEvents"]


def request_windows(events: list[dict], samples: int) -> tuple[list[dict], dict[str, list[float]]]:
    """prompt_timeline's trace cut into its requests, each between two cudaStreamQuery markers: per request its
    times (us), and the durations of the runtime calls made in it by name."""
    runtime = sorted((e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")), key=lambda e: e["ts"])
    device = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                    key=lambda e: e["ts"])
    queries = [e for e in runtime if "StreamQuery" in e["name"]]
    rows, slow_calls = [], defaultdict(list)
    for k in range(min(samples, len(queries) // 2)):
        begin, end = queries[2 * k]["ts"], queries[2 * k + 1]["ts"]
        calls = [e for e in runtime if begin <= e["ts"] < end]
        # The first token is on the host when the last wait for an event returns; the device work that ended
        # by then is the prompt's (the lookahead step launched meanwhile runs on past it).
        waits = [e["ts"] + e["dur"] for e in calls if "EventSynchronize" in e["name"]]
        token = max(waits, default=end)
        work = [e for e in device if begin <= e["ts"] and e["ts"] + e["dur"] <= token]
        if not work:
            continue
        first, last = work[0]["ts"], max(e["ts"] + e["dur"] for e in work)
        rows.append({"total_us": end - begin, "host_before_gpu_us": first - begin, "gpu_span_us": last - first,
                     "gpu_busy_us": sum(e["dur"] for e in work), "gpu_end_to_token_us": token - last,
                     "token_to_step_out_us": end - token, "kernels": len(work)})
        for e in calls:
            slow_calls[e["name"]].append(e["dur"])
    return rows, slow_calls


def prompt_timeline(path: str, prompt_len: int, samples: int = 8) -> dict:
    """Where a lone request's time to first token goes, as latency.py takes it (graphs, async scheduling, two
    tokens, run to the end): torch.profiler's trace of `samples` such requests (CUDA activity and the runtime
    calls that launch it), each cut from a marker before add_request to one after its first token is out of
    LLMEngine.step. Per request: the host's time before the first kernel starts, the GPU's span and busy time up
    to the first token (the lookahead step's kernels, launched meanwhile, are left out), the wait from the GPU's
    end to the token on the host, and from there to the token out of step(); and the runtime calls by time."""
    import random
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    from tinyvllm import LLM, SamplingParams

    rng = random.Random(1)
    llm = LLM(path, skip_tokenizer_init=True, max_model_len=4096, max_num_seqs=8, gpu_memory_utilization=0.5)
    engine = llm.llm_engine
    two = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    def sample(i: int, marks: list | None, engine=engine) -> None:
        request_id = f"t{i}"
        torch.cuda.synchronize()
        if marks is not None:
            marks.append(time.perf_counter())
        engine.add_request(request_id, [rng.randrange(10000) for _ in range(prompt_len)], two, output_kind="delta")
        while not any(o.request_id == request_id and o.outputs[0].token_ids for o in engine.step()):
            pass
        if marks is not None:
            marks.append(time.perf_counter())
        while engine.has_unfinished_requests():
            engine.step()

    for i in range(4):
        sample(-1 - i, None)
    marks: list[float] = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(samples):
            torch.cuda.synchronize()
            torch.cuda.current_stream().query()  # (a runtime call in the trace: the sample's start)
            sample(i, marks)
            torch.cuda.current_stream().query()  # (and its end, the first token out of step())
        torch.cuda.synchronize()
    events = trace_events(prof)
    del llm, engine
    torch.cuda.empty_cache()
    rows, slow_calls = request_windows(events, samples)
    med = {key: sorted(r[key] for r in rows)[len(rows) // 2] for key in rows[0]} if rows else {}
    wall = sorted(b - a for a, b in zip(marks[::2], marks[1::2]))
    print(f"\n  a lone {prompt_len}-token request to its first token (graphs, async; {len(rows)} samples, "
          f"medians; wall {wall[len(wall) // 2] * 1e3:.3f} ms, under the profiler):")
    for key, value in med.items():
        print(f"    {key:<20} {value:9.1f}")
    print("    runtime calls per sample (count, total us):")
    for name, durs in sorted(slow_calls.items(), key=lambda kv: -sum(kv[1]))[:10]:
        print(f"      {name:<40} {len(durs) / max(len(rows), 1):6.1f} {sum(durs) / max(len(rows), 1):9.1f}")
    return {"samples": rows, "medians": med,
            "runtime_calls": {k: [len(v) / max(len(rows), 1), sum(v) / max(len(rows), 1)]
                              for k, v in slow_calls.items()}}


def _group(name: str) -> str:
    lowered = name.lower()
    for key, group in (("fused_linear", "decode products (fused_linear)"),
                       ("gemv", "matmul (cuBLAS)"), ("gemm", "matmul (cuBLAS)"), ("nvjet", "matmul (cuBLAS)"),
                       ("cutlass", "matmul (cuBLAS)"), ("sm90", "matmul (cuBLAS)"), ("splitk", "matmul (cuBLAS)"),
                       ("decode", "attention decode"), ("prefill", "attention prefill"), ("rms", "rmsnorm"),
                       ("rotary_and_store", "rotary + kv store"), ("rotary", "rotary"), ("rope", "rotary"),
                       ("silu", "silu_and_mul"),
                       ("store_kv", "kv store"), ("embedding", "embedding"), ("sample", "sampling"),
                       ("memcpy", "memcpy"), ("memset", "memset")):
        if key in lowered:
            return group
    return "other: " + name[:40]


def engine_timeline(path: str, batch: int = 1, context: int = 128, steps: int = 20) -> dict:
    """The GPU timeline of `steps` engine steps (graphs, async scheduling, greedy), from torch.profiler's
    trace: device work is matched to the API call that launched it by correlation id, so a kernel is the
    graph's when a cudaGraphLaunch launched it. A step runs from one graph's first kernel to the next's."""

    import torch
    from torch.profiler import ProfilerActivity, profile

    llm = decoding_llm(path, batch, context, temperature=0.0)
    engine = llm.llm_engine
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    # CUDA activity only (with the API calls that launch work): tracing every CPU op would slow the host
    # until it, not the GPU, set the step's pace
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    events = trace_events(prof)
    del llm, engine
    torch.cuda.empty_cache()
    launcher = {e["args"]["correlation"]: e["name"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    device = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                    key=lambda e: e["ts"])
    in_graph = ["Graph" in launcher.get(e["args"].get("correlation"), "") for e in device]
    starts = [i for i, g in enumerate(in_graph) if g and (i == 0 or not in_graph[i - 1])]

    def label(e: dict) -> str:
        return e["name"][:40] if "memcpy" in e.get("cat", "") else _group(e["name"])

    periods, busy_graph, busy_outside, gaps_graph, idle = [], 0.0, 0.0, 0.0, 0.0
    outside: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])  # launches, busy us, idle before
    for first, nxt in zip(starts, starts[1:]):
        periods.append(device[nxt]["ts"] - device[first]["ts"])
        for i in range(first, nxt):
            e, after = device[i], device[i + 1]
            gap = max(0.0, after["ts"] - (e["ts"] + e["dur"]))
            if in_graph[i]:
                busy_graph += e["dur"]
            else:
                busy_outside += e["dur"]
                outside[label(e)][0] += 1
                outside[label(e)][1] += e["dur"]
            if in_graph[i] and in_graph[i + 1] and i + 1 != nxt:
                gaps_graph += gap  # between two kernels of one graph
            else:
                idle += gap
                outside["next step's graph" if i + 1 == nxt else label(after)][2] += gap
    n = max(len(periods), 1)
    result = {"batch": batch, "steps": len(periods),
              "period_us_median": sorted(periods)[len(periods) // 2] if periods else 0.0,
              "graph_us": busy_graph / n, "gaps_in_graph_us": gaps_graph / n,
              "outside_graph_us": busy_outside / n, "idle_outside_graph_us": idle / n,
              "outside": {k: {"launches": v[0] / n, "busy_us": v[1] / n, "idle_before_us": v[2] / n}
                          for k, v in outside.items()}}
    print(f"\n  GPU timeline of {len(periods)} engine steps, batch {batch} (graphs, async, greedy): period "
          f"{result['period_us_median']:.1f} us median. Per step: graph kernels {result['graph_us']:.1f} us "
          f"+ gaps between them {result['gaps_in_graph_us']:.1f} us; outside the graph, work "
          f"{result['outside_graph_us']:.1f} us + idle {result['idle_outside_graph_us']:.1f} us")
    print("    outside the graph, per step:            launches   busy us   idle before us")
    for name, row in sorted(result["outside"].items(), key=lambda kv: -(kv[1]["busy_us"] + kv[1]["idle_before_us"])):
        print(f"      {name:<40} {row['launches']:5.1f} {row['busy_us']:9.1f} {row['idle_before_us']:12.1f}")
    return result


def graph_step_ms(path: str, batch: int, context: int, **engine_args) -> float:
    """GPU time of one decode step's graph (16 layers) at `batch`, by CUDA events: the model runner's CUDA
    graph of that size replayed over the inputs of the engine's last decode step, still in its buffers."""
    import torch

    llm = decoding_llm(path, batch, context, **engine_args)
    engine = llm.llm_engine
    graphs = engine.engine_core.model_runner.cuda_graphs
    bs = next(b for b in graphs.batch_sizes if b >= batch)
    ms = cuda_ms(graphs.graphs[bs, False, None].replay, 50)  # (the graph that ends in hidden states)
    print(f"  graph replay, batch {batch} (graph {bs}): {ms:.3f} ms")
    del llm, engine
    torch.cuda.empty_cache()
    return ms


# The ops part 5 knocks out: what the model calls (tinyvllm.ops.<name>) and a stand-in that launches nothing. The
# fused add + RMSNorm runs only where the norms are not folded (tensor parallelism, biases, float16, the decode
# kernels' rows).
KNOCKOUTS = {
    "RoPE + KV store": ("rope_store", lambda qkv, rope, norm=None: qkv),
    "SiLU·mul": ("silu_and_mul", lambda x, norm=None: x[..., : x.shape[-1] // 2]),
    "fused add + RMSNorm": ("fused_add_rms_norm", lambda x, residual, weight, eps: (x, residual)),
    "decode attention": ("paged_attention", lambda q, k_cache, v_cache, meta, scale, out=None: q),
}


def knockout(path: str, batch: int, context: int, **engine_args) -> dict:
    """Part 5 at `batch` sequences of `context` tokens: microseconds of the decode graph (to hidden states, best of 3
    x 50 replays) with every op, and with each of KNOCKOUTS swapped for its stand-in."""
    import torch

    from tinyvllm import ops

    def graph_us() -> float:
        llm = decoding_llm(path, batch, context, temperature=0.0, **engine_args)
        graphs = llm.llm_engine.engine_core.model_runner.cuda_graphs
        bs = next(b for b in graphs.batch_sizes if b >= batch)
        us = min(cuda_ms(graphs.graphs[bs, False, None].replay, 50) for _ in range(3)) * 1e3
        del llm, graphs
        torch.cuda.empty_cache()
        return us

    result = {"batch": batch, "context": context, "graph_us": graph_us(), "saved_us": {}}
    print(f"\n  knockout, batch {batch}, context ~{context}: the decode graph to hidden states "
          f"{result['graph_us']:.1f} us")
    for name, (op, stand_in) in KNOCKOUTS.items():
        original = getattr(ops, op)
        setattr(ops, op, stand_in)
        try:
            us = graph_us()
        finally:
            setattr(ops, op, original)
        saved = result["graph_us"] - us
        result["saved_us"][name] = saved
        print(f"    without {name:<22} {us:8.1f} us: it costs {saved:7.1f} us ({saved / result['graph_us']:5.1%})")
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--batches", default="1,256")
    parser.add_argument("--timeline-only", action="store_true", help="only part 3, the engine's GPU timeline")
    parser.add_argument("--prompt", type=int, default=None, metavar="N", help="also part 4, a lone N-token prompt")
    parser.add_argument("--prompt-only", action="store_true", help="only part 4")
    parser.add_argument("--steps-only", action="store_true", help="only part 2, the decode steps of --batches")
    parser.add_argument("--knockout", action="store_true",
                        help="only part 5: each small op's cost inside the decode graphs of --batches")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "fp8_e4m3"),
                        help="part 2's engines: auto (the model's dtype) or fp8 (float8 e4m3)")
    args = parser.parse_args()
    require_gpu(parser)
    path = random_llama_1b()
    result = {"commit": commit(), "gpu": gpu_name()}
    cache = f", kv_cache_dtype {args.kv_cache_dtype} in the decode steps" if args.kv_cache_dtype != "auto" else ""
    print(f"profile_step on {result['gpu']} at {result['commit']}{cache}")
    result["kv_cache_dtype"] = args.kv_cache_dtype
    if args.prompt:
        result["prompt"] = prompt_breakdown(path, args.prompt)
        result["prompt"]["timeline"] = prompt_timeline(path, args.prompt)
        print("matrix products at the prompt's rows (16 distinct weights per shape, CUDA graph):")
        result["prompt"]["matmuls"] = bench_matmuls([args.prompt])
        if args.prompt_only:
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(result, f, indent=1)
            return
    if args.knockout:
        engine_args = {"kv_cache_dtype": args.kv_cache_dtype}
        result["knockout"] = [knockout(path, int(b), 128 if int(b) == 1 else 512, **engine_args)
                              for b in args.batches.split(",")]
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return
    if not args.steps_only:
        result["timeline"] = engine_timeline(path)
    if not args.timeline_only:
        if not args.steps_only:
            print("matrix products (16 distinct weights per shape, CUDA graph):")
            result["matmuls"] = bench_matmuls([1, 8, 64, 256])
        result["steps"] = []
        for batch in (int(b) for b in args.batches.split(",")):
            context = 128 if batch == 1 else 512
            eager = kernel_breakdown(path, batch, context, kv_cache_dtype=args.kv_cache_dtype)
            eager["graph_replay_ms"] = graph_step_ms(path, batch, context, kv_cache_dtype=args.kv_cache_dtype)
            result["steps"].append(eager)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
