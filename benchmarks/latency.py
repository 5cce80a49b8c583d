"""latency-b1 (docs/benchmarks.md): batch 1, 128-token prompt, 256 greedy tokens, ignore_eos.

Ours against transformers on the same model in the same run: `generate` with a static cache (its
decode step compiled, CUDA graphs) after a warm-up, and eager `generate` on a shorter run.

    python benchmarks/latency.py [--json FILE]     (H200: the random-weight Llama-3.2-1B shape)
    python benchmarks/latency.py --small           (CPU: a tiny random Llama, 16 prompt and 8 output tokens; its
                                                    figures mean nothing, it shows that the script runs)"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from common import SHAPES, commit, cuda_ms, gpu_name, random_llama_tiny, random_shape, require_gpu


def copy_bytes_per_s() -> float:
    """This GPU's device-to-device copy rate, bytes read + written per second (1 GiB copied; docs/benchmarks.md counts
    the H200's 4,159 GB/s so)."""
    import torch

    src = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / (cuda_ms(lambda: dst.copy_(src), reps=20) / 1e3)


def decode_floor_ms(model, copy_rate: float) -> float:
    """A batch-1 decode step's floor: the bytes of the weights it reads (every parameter, the embedding only where it
    is the LM head) at the copy rate (0.594 ms for the 1B model in bf16 on an H200)."""
    embedding = model.get_input_embeddings().weight
    read = [p for p in model.parameters() if p is not embedding or model.lm_head is None]
    return sum(p.numel() * p.element_size() for p in read) / copy_rate * 1e3


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
    ttft = statistics.median(timed(1) for _ in range(5))
    total = timed(output_len)
    return {"ttft_ms": ttft * 1e3, "tpot_ms": (total - ttft) / (output_len - 1) * 1e3}


def step_breakdown(llm, prompt_len: int, output_len: int,
                   record_gpu_time: bool = False) -> tuple[dict[str, float], int]:
    """Where a decode step's time goes, from the engine's StepStats (LLMEngine.add_step_callback), over the
    steps that only decode: the host time of each phase, the rest of the step's wall-clock period, and with
    record_gpu_time each step's device time (CUDA events); then, on one GPU, the device time of a batch-1
    decode through the model runner's CUDA graphs and of its greedy sampling (decode_gpu_ms). Returns
    the figures (ms, means per step) and the number of decode steps.

    A step's period runs from the callback of the step before to its own. With async scheduling a step is
    scheduled and launched during the step before it, then waits for its own tokens ('wait': the device time
    the host could not hide), so a period holds the next step's schedule and launch and its own wait and
    update; the rest is LLMEngine.step's other work (the output processor)."""
    from tinyvllm import SamplingParams

    engine = llm.llm_engine
    steps: list = []  # (StepStats, seconds since the callback of the step before)
    last = [0.0]

    def on_step(stats) -> None:
        now = time.perf_counter()
        steps.append((stats, now - last[0]))
        last[0] = now

    engine.add_step_callback(on_step, record_gpu_time=record_gpu_time)  # (for the rest of this engine's life)
    prompt = [(100 + i) % engine.model_config.vocab_size for i in range(prompt_len)]
    engine.add_request("breakdown", prompt, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    last[0] = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    # Each phase counts in the period it ran in: a step whose inputs were in flight (async scheduling) was
    # scheduled and launched during the step before, so the phases of a period add up to it.
    launched_in: dict[int, list] = {}
    for i, (stats, _) in enumerate(steps):
        launched_in.setdefault(i - 1 if stats.num_inputs_in_flight and i else i, []).append(stats)
    decode = [i for i, (stats, _) in enumerate(steps) if stats.num_prefill_tokens == 0]
    result: dict[str, float] = {}
    if decode:
        def mean(values) -> float:
            return sum(values) / len(decode)

        result["schedule"] = mean(sum(s.schedule_ms for s in launched_in.get(i, ())) for i in decode)
        result["launch (inputs, forward pass, sampler)"] = mean(
            sum(s.launch_ms for s in launched_in.get(i, ())) for i in decode)
        result["wait for the tokens (device time not hidden)"] = mean(steps[i][0].wait_ms for i in decode)
        result["update (the scheduler takes the tokens)"] = mean(steps[i][0].update_ms for i in decode)
        period = mean(steps[i][1] * 1e3 for i in decode)
        result["rest of LLMEngine.step (output processor)"] = period - sum(result.values())
        result["whole step (callback to callback)"] = period
        gpu = [steps[i][0].gpu_ms for i in decode if steps[i][0].gpu_ms is not None]
        if gpu:
            result["GPU: whole step (CUDA events)"] = sum(gpu) / len(gpu)
    if engine.device.type == "cuda" and engine.config.tensor_parallel_size == 1:  # (rank 0 alone would hang)
        result.update(decode_gpu_ms(llm, prompt_len + output_len))
    return result, len(decode)


def decode_gpu_ms(llm, context: int) -> dict[str, float]:
    """GPU time (CUDA events) of one decode at batch 1 and `context` tokens through the model runner's CUDA
    graphs (with the copy of the inputs into the graph's buffer), if it has them, and of a greedy step's
    sampling as the runner does it (ModelRunner.sample: the LM head's fused argmax where it applies) and through
    the logits and the sampler (both with the tokens' copy to the host)."""
    import numpy as np
    import torch

    from tinyvllm.worker.sampler import SamplingTensors

    engine = llm.llm_engine
    runner, block_size, device = engine.engine_core.model_runner, engine.config.block_size, engine.device
    num_blocks = min(-(-context // block_size), engine.engine_core.block_manager.num_blocks)
    context = min(context, num_blocks * block_size)
    # One sequence, its KV in blocks 0, 1, ...; slot -1: the step stores no K/V
    arrays = dict(input_ids=np.full(1, 100), positions=np.full(1, context - 1), slot_mapping=np.full(1, -1),
                  context_lens=np.array([context], dtype=np.int32), logits_indices=np.zeros(1, dtype=np.int64),
                  block_tables=np.arange(num_blocks, dtype=np.int32)[None])
    result = {}
    with torch.inference_mode():  # the engine's tensors are inference tensors
        graphs = runner.cuda_graphs
        if graphs is not None:

            def step(mode: str | None = None) -> torch.Tensor:
                # (over the graphs' own input and token buffers: nothing is in flight once the run has ended)
                graphs.inputs.upload(runner._staging, arrays)
                return graphs.replay(1, False, mode)

            layers = engine.model_config.num_layers
            result[f"GPU: decode graph replay, batch 1 (inputs in + {layers} layers)"] = cuda_ms(step, 100)
            hidden = step()[:1]
            if graphs.tail_mode(SamplingTensors.greedy()) is not None:
                result[f"GPU: decode graph replay to greedy tokens, batch 1 (inputs in + {layers} layers + LM head "
                       "+ argmax: a whole greedy step)"] = cuda_ms(lambda: step("greedy"), 100)
        else:
            hidden = torch.randn(1, engine.model_config.hidden_size, dtype=runner.dtype, device=device)
        greedy, rows = SamplingTensors.greedy(), np.zeros(1, dtype=np.int64)
        result["GPU: LM head + greedy sampling (ModelRunner.sample)"] = cuda_ms(
            lambda: runner.sample(hidden, greedy, rows, [0]), 100)
        result["GPU: LM head logits + greedy sampler"] = cuda_ms(
            lambda: runner.sampler(runner.model.compute_logits(hidden), greedy, runner.input_batch, rows, [0]), 100)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the random-weight model of --shape")
    parser.add_argument("--shape", default="llama-1b", choices=tuple(SHAPES),
                        help="the random-weight model's shape (default: Llama-3.2-1B's)")
    parser.add_argument("--small", action="store_true",
                        help="CPU-sized: a tiny random Llama, ours and the transformers peer on the CPU")
    parser.add_argument("--prompt-len", type=int, default=None, help="default 128; --small: 16")
    parser.add_argument("--output-len", type=int, default=None, help="default 256; --small: 8")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--no-async-scheduling", action="store_true", help="launch each step after the last ends")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks, one GPU each (issue 7)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="auto (the model's dtype) or fp8 (float8 e4m3, sm_89+: half the KV bytes of bf16)")
    parser.add_argument("--quantization", default=None, choices=("fp8",), help="the weights' format (default: bf16)")
    parser.add_argument("--quantize-lm-head", action="store_true", help="with --quantization fp8: the LM head too")
    parser.add_argument("--no-step-gpu-time", action="store_true",
                        help="time the breakdown's steps on the host only (on a GPU each step is also timed by CUDA "
                             "events, which adds a little host time to its launch)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    require_gpu(parser, args.small)
    for name, large, small in (("prompt_len", 128, 16), ("output_len", 256, 8)):
        if getattr(args, name) is None:
            setattr(args, name, small if args.small else large)
    if args.output_len < 2:
        parser.error("--output-len must be at least 2 (time per output token is measured after the first)")
    path = args.model or (random_llama_tiny() if args.small else random_shape(args.shape))
    device = "cpu" if args.small else "cuda"

    from tinyvllm import LLM
    from tinyvllm.entrypoints.bench_offline import run_latency

    llm = LLM(path, skip_tokenizer_init=True, enforce_eager=args.enforce_eager, max_model_len=4096,
              gpu_memory_utilization=0.5, async_scheduling=not args.no_async_scheduling,
              tensor_parallel_size=args.tensor_parallel_size, kv_cache_dtype=args.kv_cache_dtype,
              quantization=args.quantization, quantize_lm_head=args.quantize_lm_head,
              **({"device": "cpu"} if args.small else {}))
    floor_ms = None if args.small or args.tensor_parallel_size > 1 else decode_floor_ms(
        llm.llm_engine.engine_core.model_runner.model, copy_bytes_per_s())
    try:
        ours = run_latency(llm, args.prompt_len, args.output_len)
        breakdown, decode_steps = step_breakdown(llm, args.prompt_len, args.output_len,
                                                 device == "cuda" and not args.no_step_gpu_time)
    finally:
        llm.llm_engine.shutdown()  # the tensor-parallel workers, before the peer needs the GPU
    vocab_size = llm.llm_engine.model_config.vocab_size
    prompt = [(1000 + i) % vocab_size for i in range(args.prompt_len)]  # (the 1B's: 1000, 1001, ...)
    del llm
    result = {"commit": commit(), "gpu": gpu_name(), "ours": ours, "step_breakdown_ms": breakdown,
              "step_breakdown_decode_steps": decode_steps, "tensor_parallel_size": args.tensor_parallel_size,
              "kv_cache_dtype": args.kv_cache_dtype, "quantization": args.quantization, "floor_ms": floor_ms}
    print(f"latency-b1 on {result['gpu']} at {result['commit']} ({args.prompt_len} prompt, {args.output_len} output)")
    mode = ", ".join(m for m, on in (("eager", args.enforce_eager), ("sync", args.no_async_scheduling),
                                     (f"tensor_parallel_size {args.tensor_parallel_size}",
                                      args.tensor_parallel_size > 1),
                                     (f"kv_cache_dtype {args.kv_cache_dtype}", args.kv_cache_dtype != "auto"),
                                     (f"quantization {args.quantization}", args.quantization),
                                     ("LM head quantized", args.quantize_lm_head)) if on)
    floor = "" if args.small or floor_ms is None else (f", {floor_ms / ours['tpot_ms_median']:.0%} of the "
                                                       f"{floor_ms:.3f} ms floor (the weights at this GPU's copy rate)")
    print(f"  (TTFT: the median of {ours['ttft_samples']} requests, one at a time, for tinyvllm; of 5 for "
          "transformers)")
    print(f"  tinyvllm{f' ({mode})' if mode else ''}: TTFT {ours['ttft_ms']:.2f} ms, "
          f"TPOT median {ours['tpot_ms_median']:.3f} ms ({ours['tok_per_s']:.0f} tok/s){floor}")
    print(f"  where a decode step's time goes (ms per step, mean of {decode_steps}; with async scheduling a step is "
          "launched in the step before):")
    width = max(map(len, breakdown), default=0)
    for name, ms in breakdown.items():
        print(f"    {name:<{width}} {ms:7.3f}")
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
