"""shared-prefix (docs/benchmarks.md): 256 requests sharing a 1,024-token system prompt, each with its
own 64-token question, 128 output tokens; output tok/s and time to first token with prefix caching on
and off, in the same run. `--cascade-off` adds a run with prefix caching on and cascade attention off (decode
steps then read the shared prefix once per sequence) and prints the cascade on/off ratio. `--small` is the
scaled-down CPU version on the embedded model. `--plot FILE` draws each run's steps (FILE-caching-on.png,
FILE-caching-off.png, and FILE-caching-on-cascade-off.png); `--trace` prints where each run's steps spent their
time; `--repeat N` runs each configuration N times, alternating, and compares the medians."""

from __future__ import annotations

import argparse
import random
import statistics
import time

from common import GcWatch, commit, gpu_name


def run(llm, prompts, max_tokens, recorder=None):
    """recorder: a StepRecorder of `llm`, cleared after the warm-up (only the measured steps are drawn)."""
    from tinyvllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    # Warm-up with one request of the workload: the system prompt is then hot, as on a server that has
    # answered it before (requests admitted in the same step cannot share blocks not yet computed).
    llm.generate(prompts[:1], params, use_tqdm=False)
    if recorder is not None:
        recorder.clear()
    with GcWatch() as gc_watch:
        start = time.perf_counter()
        outputs = llm.generate(prompts[1:], params, use_tqdm=False)
        seconds = time.perf_counter() - start
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs]
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    stats = llm.llm_engine.get_stats()
    hit_rate = stats["prefix_cache_hits"] / max(stats["prefix_cache_queries"], 1)
    return {"output_tok_per_s": generated / seconds, "seconds": seconds,
            "ttft_median_ms": statistics.median(ttft) * 1e3, "hit_rate": hit_rate, "gc": str(gc_watch)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="CPU: embedded model, 16 requests, 256-token prefix")
    # (smaller still: tests/test_benchmarks.py runs --small in seconds)
    parser.add_argument("--num-requests", type=int, default=None, help="default 256; --small: 16 (at least 2)")
    parser.add_argument("--prefix-len", type=int, default=None, help="shared tokens (default 1024; --small: 256)")
    parser.add_argument("--question-len", type=int, default=None, help="default 64; --small: 32")
    parser.add_argument("--output-len", type=int, default=None, help="default 128; --small: 16")
    parser.add_argument("--cascade-off", action="store_true",
                        help="also run with prefix caching on and cascade attention off, and print the ratio")
    parser.add_argument("--trace", action="store_true",
                        help="per step: wall clock, host and GPU time, for prompt and decode steps (as throughput.py)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run each configuration this many times, alternating them, and compare the medians "
                        "(the GPU machine's host has varied by 10-15%% between runs)")
    parser.add_argument("--plot", default=None, metavar="FILE",
                        help="draw each run's steps into a PNG: FILE-caching-on.png, FILE-caching-off.png "
                        "(and with --cascade-off FILE-caching-on-cascade-off.png; needs matplotlib)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="auto (the model's dtype) or fp8 (float8 e4m3, sm_89+: twice the blocks of bf16)")
    args = parser.parse_args()
    from tinyvllm.entrypoints.step_plot import StepRecorder, import_matplotlib, plot_path, plot_steps

    if args.plot:
        try:
            import_matplotlib()  # before the runs, not after them
        except ImportError as e:
            parser.error(str(e))
    small = {"num_requests": 16, "prefix_len": 256, "question_len": 32, "output_len": 16}
    large = {"num_requests": 256, "prefix_len": 1024, "question_len": 64, "output_len": 128}
    for name, value in (small if args.small else large).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.num_requests < 2:
        parser.error("--num-requests must be at least 2 (one warms the prefix, the others are measured)")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    n, prefix_len, question_len, out_len = args.num_requests, args.prefix_len, args.question_len, args.output_len
    from tinyvllm import LLM

    if args.small:
        path, kwargs = None, {"device": "cpu"}
    else:
        from common import random_llama_1b

        path, kwargs = random_llama_1b(), {"skip_tokenizer_init": True, "max_model_len": 4096}
    kwargs["kv_cache_dtype"] = args.kv_cache_dtype
    rng = random.Random(0)
    system = [rng.randrange(10000) for _ in range(prefix_len)]
    prompts = [system + [rng.randrange(10000) for _ in range(question_len)] for _ in range(n)]
    print(f"shared-prefix on {gpu_name()} at {commit()}: {n} requests, {prefix_len}-token shared prefix, "
          f"{question_len}-token questions, {out_len} output tokens (one request warms the prefix first)"
          + (f", kv_cache_dtype {args.kv_cache_dtype}" if args.kv_cache_dtype != "auto" else ""))
    results: dict[tuple[bool, bool], list[dict]] = {}
    # (prefix caching, cascade attention); without caching no two sequences share blocks, so cascade never applies
    configs = [(True, True), *([(True, False)] if args.cascade_off else []), (False, True)]
    for i, (caching, cascade) in enumerate(configs * args.repeat):
        name = f"caching {'on' if caching else 'off'}" + ("" if cascade else ", cascade off")
        if i >= len(configs):
            name += f" (run {i // len(configs) + 1})"
        llm = LLM(path, enable_prefix_caching=caching, cascade_attention=cascade, **kwargs)
        recorder = StepRecorder.attach(llm) if args.plot or args.trace else None
        r = run(llm, prompts, out_len, recorder)
        results.setdefault((caching, cascade), []).append(r)
        print(f"  prefix {name}: {r['output_tok_per_s']:,.0f} output tok/s "
              f"({r['seconds']:.2f} s), median TTFT {r['ttft_median_ms']:.0f} ms, hit rate {r['hit_rate']:.0%}; "
              f"{r['gc']}")
        if args.trace:
            from throughput import print_trace, summarize_trace

            print_trace(summarize_trace(recorder.steps(), n))
        if args.plot:
            plot = plot_path(args.plot, name, only=False)
            plot_steps(recorder.records, plot, f"shared-prefix, prefix {name}: "
                       f"{r['output_tok_per_s']:,.0f} output tok/s, hit rate {r['hit_rate']:.0%}\n{n - 1} measured "
                       f"requests, {prefix_len}-token shared prefix, {question_len}-token questions, {out_len} "
                       f"output tokens", start=recorder.start)
            print(f"    steps drawn in {plot}")
        del llm
    speed = {key: statistics.median(r["output_tok_per_s"] for r in runs) for key, runs in results.items()}
    note = f" (medians of {args.repeat} runs each)" if args.repeat > 1 else ""
    print(f"  caching on / off: {speed[True, True] / speed[False, True]:.2f}x throughput{note}")
    if args.cascade_off:
        print(f"  cascade attention on / off (caching on): {speed[True, True] / speed[True, False]:.2f}x "
              f"throughput{note}")


if __name__ == "__main__":
    main()
