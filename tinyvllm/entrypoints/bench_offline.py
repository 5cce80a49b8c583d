"""The latency and throughput workloads of docs/benchmarks.md, for `tinyvllm bench` and benchmarks/."""

from __future__ import annotations

import os
import random
import shutil
import statistics
import time
from collections.abc import Callable
from typing import Any

from tinyvllm.sampling_params import SamplingParams

# The benchmark model of docs/benchmarks.md: Llama-3.2-1B's shape, random weights.
LLAMA_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    bos_token_id=128000, eos_token_id=128001, initializer_range=0.02,
)


# The other families' benchmark shapes (issue 46: each family's speed against its own weights' floor), random weights.
QWEN3_1_7B = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, bos_token_id=151643, eos_token_id=151645,
    initializer_range=0.02,
)
GEMMA2_2B = dict(
    vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=True,
    query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
    hidden_activation="gelu_pytorch_tanh", rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    bos_token_id=2, eos_token_id=1, initializer_range=0.02,
)
# --shape of the GPU benchmarks: name -> (transformers family, config).
SHAPES: dict[str, tuple[str, dict]] = {"llama-1b": ("Llama", LLAMA_1B), "qwen3-1.7b": ("Qwen3", QWEN3_1_7B),
                                       "gemma2-2b": ("Gemma2", GEMMA2_2B)}


# The same architecture at toy size, for running a GPU benchmark on a CPU (--small of benchmarks/serve.py,
# latency.py and throughput.py).
LLAMA_TINY = {**LLAMA_1B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "bos_token_id": 0,
              "eos_token_id": 1}


def draw_norm_weights(model: Any) -> None:
    """Every RMSNorm weight of a transformers model drawn from U(0.5, 1.5). transformers starts them at 1, which a
    trained model's are not, and which would hide a wrong fold of them (LlamaForCausalLM.fold_norms)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)


def random_llama(path: str, shape: dict, dtype: str = "bfloat16", family: str = "Llama") -> str:
    """Saves (once) a random-weight {family}ForCausalLM of `shape` and returns its directory."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    import torch
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**shape)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = getattr(transformers, f"{family}ForCausalLM")(config).to(getattr(torch, dtype))
    draw_norm_weights(model)
    # Saved beside, then renamed into place: a run that starts meanwhile (tests run the --small benchmarks)
    # finds a whole checkpoint or none, never a config.json without its weights.
    partial = f"{path}.partial-{os.getpid()}"
    model.save_pretrained(partial)
    del model
    try:
        os.rename(partial, path)
    except OSError:  # another process saved it first (else a directory is in the way: say so)
        shutil.rmtree(partial, ignore_errors=True)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # a server started next sizes its KV cache from the memory left free
    return path


def random_llama_1b(path: str = "/tmp/llama-1b-random") -> str:
    """The random-weight bf16 Llama-3.2-1B-shaped checkpoint of docs/benchmarks.md."""
    return random_llama(path, LLAMA_1B)


def random_shape(name: str) -> str:
    """The random-weight bf16 checkpoint of SHAPES[name] (llama-1b: random_llama_1b's)."""
    if name == "llama-1b":
        return random_llama_1b()
    family, shape = SHAPES[name]
    return random_llama(f"/tmp/{name}-random", shape, family=family)


def random_llama_tiny(path: str = "/tmp/llama-tiny-random") -> str:
    """LLAMA_TINY in float32: the model of the GPU benchmarks' --small runs on a CPU."""
    return random_llama(path, LLAMA_TINY, "float32")


def _sync(llm: Any) -> None:
    if llm.llm_engine.device.type == "cuda":
        import torch

        torch.cuda.synchronize()


def run_latency(llm: Any, prompt_len: int = 128, output_len: int = 256, seed: int = 0,
                batch_size: int = 1, ttft_samples: int = 16) -> dict[str, float]:
    """latency-b1 (batch_size 1): requests of prompt_len random tokens, greedy, all started together; the median
    time per output token (each engine step ends by reading the sampled tokens on the host, so step times are
    real). Time to first token: the median over `ttft_samples` requests sent one at a time, each of fresh tokens
    (no prefix-cache hit), from add_request to its first token (one sample moved by a millisecond from run to
    run)."""
    engine = llm.llm_engine
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size

    def random_prompt() -> list[int]:
        return [rng.randrange(min(vocab, 10000)) for _ in range(prompt_len)]

    prompts = [random_prompt() for _ in range(batch_size)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)  # warm-up
    # Two tokens each, run to their end: the first step launches the second's step before it reads the first
    # token, as any request's does. (An abort instead left that step in flight, and the next request's first
    # token came one engine step later: after that stale step had been read back and its outputs processed.)
    ttfts, two = [], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for i in range(ttft_samples):
        prompt, request_id = random_prompt(), f"ttft-{i}"
        _sync(llm)
        start = time.perf_counter()
        engine.add_request(request_id, prompt, two, output_kind="delta")
        while not any(o.request_id == request_id and o.outputs[0].token_ids for o in engine.step()):
            pass
        ttfts.append(time.perf_counter() - start)
        while engine.has_unfinished_requests():
            engine.step()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"latency-{i}", prompt, params, output_kind="final_only")
    _sync(llm)
    step_times = []
    start = last = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        now = time.perf_counter()
        step_times.append(now - last)
        last = now
    total = last - start
    decode = step_times[1:]
    return {
        "ttft_ms": statistics.median(ttfts) * 1e3 if ttfts else step_times[0] * 1e3,
        "tpot_ms_median": statistics.median(decode) * 1e3,
        "tpot_ms_mean": statistics.mean(decode) * 1e3,
        "tok_per_s": batch_size / statistics.median(decode),
        "total_s": total,
        "ttft_samples": len(ttfts),
    }


def random_workload(num_prompts: int, input_len: int, output_len: int, seed: int = 0,
                    vocab_size: int = 10001) -> tuple[list[list[int]], list[SamplingParams]]:
    """vLLM's `--dataset-name random`: prompts of input_len random tokens, output_len tokens each (ignore_eos)."""
    rng = random.Random(seed)
    top = min(10000, vocab_size - 1)
    prompts = [[rng.randint(0, top) for _ in range(input_len)] for _ in range(num_prompts)]
    return prompts, [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=output_len)] * num_prompts


def throughput_workload(num_prompts: int = 256, min_input: int = 100, max_input: int = 1024,
                        min_output: int = 100, max_output: int = 1024, seed: int = 0,
                        temperature: float = 0.6,
                        vocab_size: int = 10001) -> tuple[list[list[int]], list[SamplingParams]]:
    """nano-vllm's bench.py: random token prompts and random output lengths, ignore_eos."""
    random.seed(seed)
    top = min(10000, vocab_size - 1)
    prompts = [[random.randint(0, top) for _ in range(random.randint(min(min_input, max_input), max_input))]
               for _ in range(num_prompts)]
    params = [SamplingParams(temperature=temperature, ignore_eos=True,
                             max_tokens=random.randint(min(min_output, max_output), max_output))
              for _ in range(num_prompts)]
    return prompts, params


def run_throughput(llm: Any, prompts: list[list[int]], params: list[SamplingParams],
                   on_start: Callable[[], None] | None = None, use_tqdm: bool = False) -> dict[str, float]:
    # Warm-up on prompts of the workload's first lengths, so that Triton compiles the kernel variants it will
    # meet (prefill, mixed, decode with and without split combining) before the clock starts. Their tokens are
    # reversed: the measured prompts themselves would leave their blocks in the prefix cache, and the measured
    # run would then skip part of its prefill.
    warm = [p[::-1] for p in prompts[: min(32, len(prompts))]]
    llm.generate(warm, SamplingParams(max_tokens=32, ignore_eos=True), use_tqdm=False)
    _sync(llm)
    if on_start is not None:  # (benchmarks/throughput.py --trace: forget the warm-up's steps)
        on_start()
    before = llm.llm_engine.get_stats()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    _sync(llm)
    seconds = time.perf_counter() - start
    stats = llm.llm_engine.get_stats()
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"output_tokens": generated, "prompt_tokens": sum(map(len, prompts)), "seconds": seconds,
            "output_tok_per_s": generated / seconds, "preemptions": stats["num_preemptions"],
            "prefix_cache_hits": stats["prefix_cache_hits"] - before["prefix_cache_hits"]}
