"""prompt-logprobs (docs/benchmarks.md): what scoring prompts costs, on an evaluation harness's workload.

Loglikelihood requests as lm-evaluation-harness sends them: --num-prompts prompts of --prompt-len random tokens,
one greedy output token each, all at once. Measured: prompt tokens per second with SamplingParams.prompt_logprobs
None (plain prefill), 1 (lm-eval's logprobs=1) and 5, alternated over --repeat rounds (best of each). Peer, in the
same run: transformers scoring the same prompts as lm-eval's `hf` backend does (a forward pass per batch of
--peer-batch prompts, log-softmax, the prompt tokens' logprobs gathered), in the engine's dtype.

    python benchmarks/prompt_logprobs.py [--json FILE]     (GPU: the random-weight Llama-3.2-1B shape, bf16)
    python benchmarks/prompt_logprobs.py --small             (CPU: the embedded SmolLM2-135M, float32, 32 x 256)"""

from __future__ import annotations

import argparse
import json
import random
import time

from common import commit, gpu_name, random_llama_1b, require_gpu


def hf_scoring(path: str, prompts: list[list[int]], batch: int, device: str, dtype_name: str,
               gguf_file: str | None) -> float:
    """transformers' prompt tokens per second, scoring as lm-eval's hf backend: logits, log-softmax, gather."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, dtype_name)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).to(device).eval()

    def run(selected: list[list[int]]) -> None:
        with torch.inference_mode():
            for start in range(0, len(selected), batch):
                ids = torch.tensor(selected[start:start + batch], device=device)
                logprobs = torch.log_softmax(model(ids).logits[:, :-1].float(), dim=-1)
                logprobs.gather(2, ids[:, 1:, None]).sum().item()

    run(prompts[:batch])  # warm-up
    start = time.perf_counter()
    run(prompts)
    seconds = time.perf_counter() - start
    return sum(len(p) for p in prompts) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="on the CPU: the embedded model, float32")
    parser.add_argument("--num-prompts", type=int, default=None, help="default 256; --small: 32")
    parser.add_argument("--prompt-len", type=int, default=None, help="default 1024; --small: 256")
    parser.add_argument("--peer-batch", type=int, default=None, help="prompts per transformers forward pass "
                        "(default 16; --small: 8)")
    parser.add_argument("--repeat", type=int, default=2, help="rounds over the three settings, alternated")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    require_gpu(parser, small=args.small)

    from tinyvllm import LLM, SamplingParams
    from tinyvllm.model.loader import embedded_model_path

    cpu = args.small
    num_prompts = args.num_prompts or (32 if cpu else 256)
    prompt_len = args.prompt_len or (256 if cpu else 1024)
    random.seed(0)
    vocab = 49152 if cpu else 128256
    prompts = [[random.randint(2, min(vocab, 10000) - 1) for _ in range(prompt_len)] for _ in range(num_prompts)]
    if cpu:
        path = embedded_model_path()
        llm = LLM(path, device="cpu", dtype="float32", enable_prefix_caching=False, max_num_seqs=num_prompts,
                  max_num_batched_tokens=4096, max_model_len=prompt_len + 16)
    else:
        path = random_llama_1b()
        llm = LLM(path, skip_tokenizer_init=True, enable_prefix_caching=False, max_num_seqs=num_prompts,
                  max_num_batched_tokens=8192, max_model_len=prompt_len + 16)
    settings = [None, 1, 5]
    llm.generate(prompts[:4], [SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k) for k in settings[1:]]
                 + [SamplingParams(temperature=0, max_tokens=1)] * 2, use_tqdm=False)  # warm-up
    best: dict[str, float] = {}
    for _ in range(args.repeat):
        for k in settings:
            params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=k)
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            rate = num_prompts * prompt_len / (time.perf_counter() - start)
            assert k is None or all(len(o.prompt_logprobs) == prompt_len for o in outputs)
            best[str(k)] = max(best.get(str(k), 0.0), rate)
    del llm

    peer = None
    if not args.no_peer:
        import os

        batch = args.peer_batch or (8 if cpu else 16)
        peer = hf_scoring(os.path.dirname(path) if cpu else path, prompts, batch, "cpu" if cpu else "cuda",
                          "float32" if cpu else "bfloat16", os.path.basename(path) if cpu else None)

    device = "CPU (embedded SmolLM2-135M, float32)" if cpu else gpu_name()
    print(f"prompt-logprobs: {num_prompts} prompts x {prompt_len} tokens, 1 output token each; {device}; "
          f"commit {commit()}")
    print(f"  {'prompt_logprobs':<18}{'prompt tok/s':>14}{'vs none':>10}{'vs transformers':>18}")
    for k in settings:
        rate = best[str(k)]
        vs_peer = f"{rate / peer:.2f}x" if peer else "-"
        print(f"  {str(k):<18}{rate:>14,.0f}{rate / best['None']:>9.2f}x{vs_peer:>18}")
    if peer:
        print(f"  transformers scoring (forward, log-softmax, gather): {peer:,.0f} prompt tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "commit": commit(), "num_prompts": num_prompts, "prompt_len": prompt_len,
                       "prompt_tok_s": best, "transformers_tok_s": peer}, f, indent=2)


if __name__ == "__main__":
    main()
