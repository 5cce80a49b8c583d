"""GPU end-to-end checks (run on a CUDA machine: `python tests/gpu/check_engine.py`).

1. The Llama-3.2-1B-shaped random-weight model's logits against transformers on the same GPU.
2. Greedy generation on CUDA with the Triton kernels agrees with the same engine on CUDA running the
   reference ops (TINYVLLM_REFERENCE_OPS=1, a subprocess), and the fast path (CUDA graphs and async
   scheduling) agrees with the eager, synchronous one.
Prints PASS/FAIL per check and exits non-zero on any failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

PROMPTS = [[(i * 37 + j * 11) % 10000 for j in range(n)] for i, n in enumerate((5, 40, 130, 300))]


def generate(path: str, dtype: str, enforce_eager: bool, async_scheduling: bool,
             num_tokens: int) -> list[list[int]]:
    from tinyvllm import LLM, SamplingParams

    llm = LLM(path, skip_tokenizer_init=True, dtype=dtype, enforce_eager=enforce_eager, max_model_len=2048,
              gpu_memory_utilization=0.3, max_num_seqs=16, async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def logits_check(path: str) -> list[tuple[str, bool, str]]:
    import torch
    from transformers import AutoModelForCausalLM

    from tests.utils import our_logits, relative_error
    from tinyvllm import LLM

    results = []
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    for dtype, tol in (("bfloat16", 3e-2), ("float32", 1e-4)):
        llm = LLM(path, skip_tokenizer_init=True, dtype=dtype, enforce_eager=True, max_model_len=2048,
                  gpu_memory_utilization=0.3, max_num_seqs=16)
        for n in (7, 300, 1500):
            ids = [(k * 7919) % 10000 for k in range(n)]
            ours = our_logits(llm, ids).float()
            with torch.inference_mode():
                ref = hf(torch.tensor([ids], device="cuda")).logits[0].float()
            err = relative_error(ours, ref)
            top1 = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
            results.append((f"logits vs transformers fp32, ours {dtype}, {n} tokens", err < tol,
                            f"rel err {err:.2e} (tol {tol}), top-1 agreement {top1:.1%}"))
        del llm
        torch.cuda.empty_cache()
    return results


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--generate":  # the subprocess: print tokens as JSON
        _, _, path, dtype, eager, overlap, n = sys.argv
        print("TOKENS" + json.dumps(generate(path, dtype, eager == "1", overlap == "1", int(n))))
        return 0
    from common import random_llama_1b

    path = random_llama_1b()
    results = logits_check(path)
    for dtype in ("float32", "bfloat16"):
        runs = {}
        for name, env, eager, overlap in (("triton+graphs+async", {}, "0", "1"), ("triton+graphs", {}, "0", "0"),
                                          ("triton eager", {}, "1", "0"),
                                          ("reference ops", {"TINYVLLM_REFERENCE_OPS": "1"}, "1", "0")):
            proc = subprocess.run([sys.executable, __file__, "--generate", path, dtype, eager, overlap, "64"],
                                  env={**os.environ, **env}, capture_output=True, text=True)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("TOKENS")), None)
            if line is None:
                results.append((f"generate {name} {dtype}", False, proc.stderr[-2000:]))
                continue
            runs[name] = json.loads(line[len("TOKENS"):])
        for a, b in (("triton eager", "reference ops"), ("triton+graphs", "triton eager"),
                     ("triton+graphs+async", "triton eager")):
            if a in runs and b in runs:
                same = [x == y for x, y in zip(runs[a], runs[b])]
                prefix = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x))
                          for x, y in zip(runs[a], runs[b])]
                detail = f"identical {sum(same)}/{len(same)}, common prefix lengths {prefix}"
                if dtype == "float32":
                    results.append((f"greedy 64 tokens: {a} == {b} ({dtype})", all(same), detail))
                else:
                    # In bf16 the two paths round differently, and random weights give near-ties (top-1
                    # agrees with fp32 on only ~90% of positions, see above), so a flip is expected
                    # somewhere: reported, not judged. Correctness is judged in fp32 and on the logits.
                    print(f"INFO  greedy 64 tokens: {a} vs {b} ({dtype}): {detail}")
    failed = 0
    for name, ok, detail in results:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
        failed += not ok
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
