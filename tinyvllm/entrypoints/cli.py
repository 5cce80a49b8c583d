"""The `tinyvllm` command: generate, chat, serve, bench serve (and the subcommands other modules add)."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import itertools
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

from tinyvllm.config import EngineConfig
from tinyvllm.sampling_params import SamplingParams, StructuredOutputsParams


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One flag per EngineConfig field (`max_num_seqs` -> --max-num-seqs), with its help and default from
    the field itself; `skip`: fields this command sets on its own."""
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        if f.name in skip:
            continue
        meta = f.metadata
        kwargs: dict[str, Any] = dict(default=f.default, help=meta["help"])
        kind = meta.get("type", type(f.default))
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif "choices" in meta:
            kwargs["choices"] = meta["choices"]
        else:
            kwargs["type"] = kind
        group.add_argument("--" + f.name.replace("_", "-"), *meta.get("aliases", ()), **kwargs)


def engine_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}
    return EngineConfig.from_kwargs(**{**values, **overrides})


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int, several: bool = True) -> None:
    """The sampling flags; several: with -n and --logprobs (generate prints several completions and logprobs; the
    interactive chat shows one answer as it streams, so it offers neither)."""
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="at most this many tokens per completion")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of this probability")
    g.add_argument("--top-k", type=int, default=-1, help="sample from the k most likely tokens (-1: all)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this fraction of the most likely")
    g.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    g.add_argument("--stop", action="append", default=None, help="stop at this string (repeatable)")
    if several:
        g.add_argument("-n", type=int, default=1, help="completions per prompt")
        g.add_argument("--logprobs", type=int, default=None,
                       help="print each token's log-probability and the N most likely tokens at its place")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, seed=args.seed, n=getattr(args, "n", 1),
                          stop=args.stop, logprobs=getattr(args, "logprobs", None))


def stream(llm: Any, prompt: str | list[int], params: SamplingParams) -> Iterator[str]:
    """Yields a request's text as it is generated."""
    engine = llm.llm_engine
    request_id = f"cli-{next(_ids)}"
    engine.add_request(request_id, prompt, params, output_kind="delta")
    try:
        while True:
            for output in engine.step():
                if output.request_id == request_id:
                    yield output.outputs[0].text
                    if output.finished:
                        return
    finally:
        engine.abort_request(request_id)


_ids = itertools.count()


def cmd_generate(args: argparse.Namespace) -> int:
    from tinyvllm import LLM

    params = sampling_params(args)
    if args.json_schema is not None:
        params = dataclasses.replace(params, structured_outputs=StructuredOutputsParams(
            json=_read_json_schema(args.json_schema)))
    llm = LLM(**vars(engine_config(args)))
    prompt: str | list[int] = args.prompt
    tokenizer = llm.get_tokenizer()
    if not args.no_chat and tokenizer is not None and tokenizer.chat_template:
        prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}])
    if params.n == 1 and params.logprobs is None:
        for text in stream(llm, prompt, params):
            print(text, end="", flush=True)
        print()
        return 0
    # Several completions, or logprobs: each completion whole, then its tokens' log-probabilities.
    for completion in llm.generate(prompt, params, use_tqdm=False)[0].outputs:
        if params.n > 1:
            print(f"--- completion {completion.index} ({completion.finish_reason}) ---")
        print(completion.text)
        for token_id, entry in zip(completion.token_ids, completion.logprobs or []):
            # (entry: the chosen token, and the N most likely, which may include it)
            top = ", ".join(f"{lp.decoded_token!r} {lp.logprob:.3f}" for _, lp in
                            sorted(entry.items(), key=lambda item: item[1].rank) if lp.rank <= params.logprobs)
            chosen = entry[token_id]
            print(f"  {chosen.decoded_token!r:>16} {chosen.logprob:8.3f}" + (f"   (top {params.logprobs}: {top})"
                                                                                if top else ""))
    return 0


def _read_json_schema(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            schema = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--json-schema {path}: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"--json-schema {path}: a JSON schema is an object, not {type(schema).__name__}")
    return schema


def cmd_chat(args: argparse.Namespace) -> int:
    from tinyvllm import LLM

    llm = LLM(**vars(engine_config(args)))
    params = sampling_params(args)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            return 0
        message = line.strip()
        if not message:
            continue
        if message in ("/exit", "/quit"):
            return 0
        history.append({"role": "user", "content": message})
        answer = []
        for text in stream(llm, llm.apply_chat_template(history), params):
            answer.append(text)
            print(text, end="", flush=True)
        print(flush=True)
        history.append({"role": "assistant", "content": "".join(answer)})


def cmd_serve(args: argparse.Namespace) -> int:
    # (fastapi, uvicorn and prometheus_client are imported here only)
    from tinyvllm.entrypoints.openai.api_server import run_server
    from tinyvllm.entrypoints.openai.launcher import run_api_servers

    args.model = args.model or args.model_tag
    return (run_api_servers if args.api_server_count > 1 else run_server)(args, engine_config(args))


def cmd_bench_latency(args: argparse.Namespace) -> int:
    from tinyvllm import LLM
    from tinyvllm.entrypoints.bench_offline import run_latency

    llm = LLM(**vars(engine_config(args, skip_tokenizer_init=True)))
    print(f"timing {args.batch_size} request(s) of {args.input_len} prompt tokens, {args.output_len} output tokens "
          "each...", file=sys.stderr, flush=True)
    r = run_latency(llm, args.input_len, args.output_len, batch_size=args.batch_size)
    print(f"latency, batch {args.batch_size}, {args.input_len} prompt tokens, {args.output_len} output tokens: "
          f"TTFT {r['ttft_ms']:.2f} ms, TPOT median {r['tpot_ms_median']:.3f} ms ({r['tok_per_s']:.1f} tok/s)")
    return 0


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from tinyvllm import LLM
    from tinyvllm.entrypoints.bench_offline import random_workload, run_throughput, throughput_workload
    from tinyvllm.entrypoints.step_plot import StepRecorder, import_matplotlib, plot_steps

    if args.plot:
        try:
            import_matplotlib()  # before the run, not after it
        except ImportError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    llm = LLM(**vars(engine_config(args, skip_tokenizer_init=True)))
    vocab_size = llm.llm_engine.model_config.vocab_size
    if args.dataset_name == "random":
        prompts, params = random_workload(args.num_prompts, args.input_len, args.output_len, vocab_size=vocab_size)
        workload = f"random, {args.input_len} prompt and {args.output_len} output tokens each"
    else:
        prompts, params = throughput_workload(args.num_prompts, max_input=args.max_input_len,
                                              max_output=args.max_output_len, vocab_size=vocab_size)
        workload = f"nano-vllm, up to {args.max_input_len} prompt and {args.max_output_len} output tokens"
    recorder = StepRecorder.attach(llm) if args.plot else None
    r = run_throughput(llm, prompts, params, on_start=recorder.clear if recorder is not None else None,
                       use_tqdm=True)
    print(f"throughput, {args.num_prompts} prompts ({r['prompt_tokens']} tokens): {r['output_tokens']} output "
          f"tokens in {r['seconds']:.2f} s = {r['output_tok_per_s']:,.1f} output tok/s, {r['preemptions']} preemptions")
    if recorder is not None:
        model = os.path.basename(os.path.normpath(args.model)) if args.model else "the embedded model"
        title = (f"tinyvllm bench throughput: {r['output_tok_per_s']:,.1f} output tok/s\n{model} on "
                 f"{llm.llm_engine.device.type}, {args.num_prompts} prompts ({workload})")
        plot_steps(recorder.records, args.plot, title, start=recorder.start)
        print(f"steps drawn in {args.plot}")
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from tinyvllm.entrypoints.bench_serve import main as bench_serve_main

    return bench_serve_main(args)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind: the default is loopback only; 0.0.0.0 binds every interface")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` (none: $TINYVLLM_API_KEY, or no key if unset)")
    g.add_argument("--served-model-name", default=None, help="the model name clients send (none: the model's)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log verbosity")
    g.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                   help="log every HTTP request: client, method, path, status, duration in ms (at level info)")
    g.add_argument("--ui", action=argparse.BooleanOptionalAction, default=True,
                   help="serve a chat page at / (open without the API key: it asks for the key and sends it with "
                        "its API calls); --no-ui: no page, / is a 404")
    g.add_argument("--max-request-body-mb", type=float, default=16.0,
                   help="refuse a request body larger than this many MB (2**20 bytes) with 413")
    g.add_argument("--shutdown-timeout", type=float, default=5.0,
                   help="on SIGINT/SIGTERM, seconds to wait for open connections before closing them")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a chat request's own chat_template (refused otherwise), in a process of its own with "
                        "a time and memory limit")
    g.add_argument("--api-server-count", type=int, default=1,
                   help="API server processes in front of the one engine core (each its own event loop, tokenizer "
                        "and detokenizer, on one listening socket): more when one process cannot keep up")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tinyvllm", description="a small, fast LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    # Every subcommand's --help shows each option's default.
    add_parser = functools.partial(sub.add_parser, formatter_class=argparse.ArgumentDefaultsHelpFormatter)

    p = add_parser("generate", help="generate a completion for one prompt, streamed")
    p.add_argument("prompt")
    p.add_argument("--no-chat", action="store_true", help="send the raw prompt, without the chat template")
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="answer with JSON that validates against the JSON schema in FILE (structured output)")
    add_engine_args(p, skip=("seed",))  # (--seed is the request's)
    add_sampling_args(p, max_tokens=256)
    p.set_defaults(func=cmd_generate)

    p = add_parser("chat", help="an interactive conversation (reads lines from stdin; /exit ends it)")
    p.add_argument("--system", default=None, help="a system prompt")
    add_engine_args(p, skip=("seed",))
    add_sampling_args(p, max_tokens=512, several=False)
    p.set_defaults(func=cmd_chat)

    p = add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as --model (`tinyvllm serve PATH`, as `vllm serve`)")
    add_serve_args(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)

    bench = add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    add_bench = functools.partial(bench_sub.add_parser, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from tinyvllm.entrypoints.bench_serve import add_cli_args as add_bench_serve_args

    p = add_bench("serve", help="load an OpenAI-compatible server and report throughput and latency")
    add_bench_serve_args(p)
    p.set_defaults(func=cmd_bench_serve)

    p = add_bench("latency", help="time to first token and time per output token of a batch (1: latency-b1)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=256, help="output tokens per request")
    p.add_argument("--batch-size", type=int, default=1, help="requests started together")
    add_engine_args(p, skip=("skip_tokenizer_init",))  # (random weights: token ids only)
    p.set_defaults(func=cmd_bench_latency)

    p = add_bench("throughput", help="offline output tokens per second")
    p.add_argument("--dataset-name", default="nano-vllm", choices=["nano-vllm", "random"],
                   help="nano-vllm: random lengths up to --max-input-len/--max-output-len (nano-vllm's bench); "
                        "random: every prompt --input-len tokens, every output --output-len (vLLM's)")
    p.add_argument("--num-prompts", type=int, default=256, help="requests")
    p.add_argument("--max-input-len", type=int, default=1024, help="nano-vllm: the longest prompt")
    p.add_argument("--max-output-len", type=int, default=1024, help="nano-vllm: the longest output")
    p.add_argument("--input-len", type=int, default=1024, help="random: prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="random: output tokens per request")
    p.add_argument("--plot", default=None, metavar="FILE",
                   help="draw the measured steps (tokens, requests, KV blocks, preemptions, step times) into a "
                        "PNG (needs matplotlib)")
    add_engine_args(p, skip=("skip_tokenizer_init",))
    p.set_defaults(func=cmd_bench_throughput)
    return parser


def _subparser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)command `args` ran."""
    for name in ("command", "bench_command"):
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not actions or getattr(args, name, None) is None:
            break
        parser = actions[0].choices[getattr(args, name)]
    return parser


def _unrecognized(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """argparse's message for unknown arguments, with the closest real flag for each misspelled one."""
    flags = [s for action in parser._actions for s in action.option_strings]
    parts = []
    for extra in extras:
        close = difflib.get_close_matches(extra.split("=", 1)[0], flags, n=1) if extra.startswith("-") else []
        parts.append(f"{extra} (did you mean {close[0]}?)" if close else extra)
    return "unrecognized arguments: " + " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        command = _subparser(parser, args)
        command.error(_unrecognized(command, extras))
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
