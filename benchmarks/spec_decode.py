"""spec-decode (docs/benchmarks.md): n-gram speculative decoding on against off, on a workload whose output copies
its prompt and on open chat.

Each workload's requests run one after another (batch 1, where a step is a read of the weights and verifying
proposals costs about the same read), greedy, so that both runs give the same text (checked). Measured: output
tokens per second of each, best of --repeat alternated rounds; the mean acceptance length (tokens a sequence gets
per verification step: 1 + accepted / verifications) and the share of proposals accepted, from the engine's
counters (vLLM's spec_decode metrics).

    python benchmarks/spec_decode.py --small    (CPU: the embedded SmolLM2-135M, float32, a few requests)
    python benchmarks/spec_decode.py [--model DIR]    (GPU: the embedded model, or DIR)
    python benchmarks/spec_decode.py --model DIR --draft-model random    (and a draft model beside n-gram)

--draft-model adds draft-model speculation (a smaller model with the target's vocabulary; "random": a 4-layer
random-weight Llama, whose guesses a random target seldom accepts: such a run measures what drafting costs, and its
acceptance says nothing about real models).

The copying workload asks the model to repeat a paragraph with one word changed (code editing and quoting look like
this); open chat asks questions whose answers repeat little, where proposals are rarely found and seldom accepted."""

from __future__ import annotations

import argparse
import time

from common import commit

PARAGRAPH = ("The old lighthouse stood at the edge of the cliff, its white paint peeling in long strips. Every night "
             "the keeper climbed the spiral stairs, one hundred and twelve of them, to light the lamp. Ships passing "
             "in the dark saw the beam sweep across the water and knew that the rocks were near. In the morning the "
             "keeper wrote the weather in a thick book, drank his tea, and slept until noon.")
COPY = [
    f"Repeat the following text exactly, but replace the word 'keeper' with 'guardian':\n\n{PARAGRAPH}",
    f"Copy this paragraph word for word, then stop:\n\n{PARAGRAPH}",
    f"Rewrite the text below in the past perfect tense, changing as little as possible:\n\n{PARAGRAPH}",
    f"Fix any spelling mistakes in this text and return it in full:\n\n{PARAGRAPH.replace('the', 'teh', 3)}",
]
CHAT = ["Why is the sky blue?", "Suggest three names for a bakery.", "What should I pack for a weekend hike?",
        "Explain what a CPU does, in a few sentences."]


def run(llm, prompts: list[str], params) -> tuple[float, list[list[int]], dict[str, float]]:
    """Each prompt alone, in turn: output tokens per second, the outputs, and the spec counters' increase."""
    before = llm.llm_engine.get_stats()
    outputs, start = [], time.perf_counter()
    for prompt in prompts:
        outputs += llm.generate([prompt], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = llm.llm_engine.get_stats()
    counts = {k: after[k] - before[k] for k in after if k.startswith("spec_decode")}
    tokens = [o.outputs[0].token_ids for o in outputs]
    return sum(map(len, tokens)) / seconds, tokens, counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="on the CPU, fewer and shorter requests (the default "
                                                             "where torch sees no GPU)")
    parser.add_argument("--model", default=None, help="model directory or .gguf (none: the embedded SmolLM2-135M)")
    parser.add_argument("--num-prompts", type=int, default=None, help="requests per workload (default 2 small, 4)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per request (default 96 small, 192)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=3, help="alternated rounds; each run's best is kept")
    parser.add_argument("--draft-model", default=None, help="also a draft model's speculation: its directory or "
                                                            ".gguf, or 'random' (a small random-weight Llama)")
    args = parser.parse_args()

    import torch

    from tinyvllm import LLM, SamplingParams

    small = args.small or not torch.cuda.is_available()
    device = "cpu" if small else "cuda"
    num_prompts = args.num_prompts or (2 if small else 4)
    max_tokens = args.max_tokens or (96 if small else 192)
    speculative = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                   "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max}
    # (both engines live in this process: on a GPU each gets a KV pool of its own size, 16k tokens, where sizing it
    # from the memory left would count the other engine's)
    memory = {} if small else {"num_kv_blocks": 1024}
    engines = {"off": LLM(args.model, device=device, **memory),
               "ngram": LLM(args.model, device=device, speculative_config=speculative, **memory)}
    if args.draft_model:
        draft = args.draft_model
        if draft == "random":
            draft = random_draft(engines["off"].llm_engine.model_config.vocab_size, small)
        engines["draft"] = LLM(args.model, device=device, speculative_config={
            "method": "draft_model", "model": draft, "num_speculative_tokens": args.num_speculative_tokens}, **memory)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    workloads = {name: [engines["off"].apply_chat_template([{"role": "user", "content": q}])
                        for q in questions[:num_prompts]] for name, questions in (("copy", COPY), ("chat", CHAT))}
    for llm in engines.values():
        llm.generate(workloads["chat"][:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    where = f"{torch.get_num_threads()} CPU threads" if small else torch.cuda.get_device_name()
    print(f"spec-decode at {commit()}: {args.model or 'SmolLM2-135M-Instruct'} on {device} ({where}), batch 1, "
          f"greedy, {num_prompts} requests per workload, up to {max_tokens} tokens; ngram k="
          f"{args.num_speculative_tokens}, lookup {args.prompt_lookup_min}..{args.prompt_lookup_max}; best of "
          f"{args.repeat} alternated rounds" + (" (a shared, busy machine: the ratios vary from run to run)"
                                                if small else ""))
    for name, prompts in workloads.items():
        best = dict.fromkeys(engines, 0.0)
        outputs, counts = {}, {}
        for _ in range(args.repeat):
            for mode, llm in engines.items():
                rate, outputs[mode], counts[mode] = run(llm, prompts, params)
                best[mode] = max(best[mode], rate)
        print(f"  {name:5s} off {best['off']:7.1f} tok/s")
        for mode in list(engines)[1:]:
            c = counts[mode]
            drafts, proposed, accepted = c["spec_decode_num_drafts"], c["spec_decode_num_draft_tokens"], \
                c["spec_decode_num_accepted_tokens"]
            length = 1 + accepted / drafts if drafts else 1.0
            share = accepted / proposed if proposed else 0.0
            same = "same output" if outputs[mode] == outputs["off"] else "OUTPUTS DIFFER"
            print(f"        {mode:5s} {best[mode]:7.1f} tok/s   {best[mode] / best['off']:.2f}x   acceptance length "
                  f"{length:.2f} ({share:.0%} of {proposed:.0f} proposals in {drafts:.0f} verifications)   {same}")


def random_draft(vocab_size: int, small: bool) -> str:
    """A random-weight 4-layer Llama with the target's vocabulary (bf16 on a GPU, float32 on the CPU)."""
    from tinyvllm.entrypoints.bench_offline import LLAMA_1B, random_llama

    shape = {**LLAMA_1B, "vocab_size": vocab_size, "hidden_size": 512, "intermediate_size": 1536,
             "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
             "bos_token_id": 0, "eos_token_id": 1}
    dtype = "float32" if small else "bfloat16"
    return random_llama(f"/tmp/draft-random-vocab{vocab_size}-{dtype}", shape, dtype)


if __name__ == "__main__":
    main()
