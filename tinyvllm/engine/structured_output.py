"""Structured output (SamplingParams.structured_outputs) through xgrammar, as vLLM and SGLang do it.

A request's constraint compiles into a grammar over the model's vocabulary on a thread of its own (xgrammar keeps
a cache of what it compiled, so a schema seen before is ready at once), while the engine steps the others; its
sequences wait in the queue until it is ready. Each sequence then has a matcher: before a step samples it, the
engine fills its row of the step's token bitmask (GrammarOutput: what it may draw next), which the sampler applies
to the logits; each token it draws advances the matcher, and the sequence stops when the grammar has ended. A
constraint is checked in the API process first (check_structured_outputs: grammars build without the tokenizer),
so that one that cannot compile is refused with a 400 before it reaches the engine.

xgrammar is imported only when a request asks for structured output."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tinyvllm.contract import GrammarOutput
from tinyvllm.sampling_params import StructuredOutputsParams

_CACHE_LIMIT_BYTES = 256 * 2**20  # xgrammar's cache of compiled grammars


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError("structured output needs the xgrammar package: pip install xgrammar") from e
    return xgrammar


def _ebnf_of_choice(choices: list[str]) -> str:
    """One of the strings, exactly: an EBNF alternative of JSON-escaped literals (xgrammar reads their escapes)."""
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)


def check_structured_outputs(params: StructuredOutputsParams) -> None:
    """Build the constraint's grammar without the vocabulary (cheap): a ValueError that says what is wrong if it
    cannot compile."""
    xgr = _xgrammar()
    kind, spec = params.key
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(spec)
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(spec)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(_ebnf_of_choice(json.loads(spec)))
    except Exception as e:  # (xgrammar raises RuntimeError, ValueError and its own, each with a message)
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        message = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", message)  # (its log prefix: time, source file and line)
        raise ValueError(f"structured_outputs.{'json' if kind == 'json' else kind} does not compile: "
                         f"{message[:500]}") from None


class SequenceGrammar:
    """One sequence's place in its grammar: the compiled grammar (on its way), then a matcher over it."""

    def __init__(self, compiled: Future[Any]) -> None:
        self.compiled = compiled
        self.matcher: Any = None
        self.rejected = False  # a token it did not allow came (none does under its mask): it has ended

    @property
    def failed(self) -> BaseException | None:
        """Why the grammar did not compile, once that is known."""
        if not self.compiled.done() or self.compiled.cancelled():  # (cancelled: the engine is shutting down)
            return None
        return self.compiled.exception()

    def ready(self) -> bool:
        """Whether it compiled (its matcher is made now, the first time)."""
        if self.matcher is None and self.compiled.done() and not self.compiled.cancelled() \
                and self.compiled.exception() is None:
            self.matcher = _xgrammar().GrammarMatcher(self.compiled.result())
        return self.matcher is not None

    def accept(self, token: int) -> None:
        """Advance past a drawn token."""
        if not self.matcher.accept_token(token):
            self.rejected = True

    def valid_drafts(self, drafts: list[int]) -> list[int]:
        """The leading proposed tokens (speculative decoding) the grammar allows from where it stands, up to the one
        that ends it; the matcher is left where it was."""
        num_valid = 0
        for token in drafts:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                break
            num_valid += 1
        if num_valid:
            self.matcher.rollback(num_valid)
        return drafts[:num_valid]

    @property
    def terminated(self) -> bool:
        """Whether the grammar has ended: the sequence stops."""
        return self.rejected or bool(self.matcher.is_terminated())


class StructuredOutputManager:
    """Compiles the requests' constraints (one thread, beside the engine's steps) and fills the steps' bitmasks.
    The tokenizer, which xgrammar needs to see the vocabulary's strings, is loaded at the first constraint."""

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self._executor: ThreadPoolExecutor | None = None
        self._compiler: Any = None
        self._lock = threading.Lock()

    def grammar(self, params: StructuredOutputsParams) -> SequenceGrammar:
        """A sequence's grammar; its compilation starts now (the sequences of one request share it)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinyvllm-grammar")
        return SequenceGrammar(self._executor.submit(self._compile, params.key))

    def share(self, grammar: SequenceGrammar) -> SequenceGrammar:
        """Another sequence's own matcher over the same compiled grammar."""
        return SequenceGrammar(grammar.compiled)

    def _compile(self, key: tuple[str, str]) -> Any:
        xgr = _xgrammar()
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self._load_tokenizer(), vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_limit_bytes=_CACHE_LIMIT_BYTES)
        kind, spec = key
        # JSON as compact text (vLLM's disable_any_whitespace): where any whitespace may stand between tokens, a small
        # or quantized model can emit newlines until max_tokens (the embedded model's 4-bit weights did, inside an
        # object) and never close its answer.
        if kind == "json":
            return self._compiler.compile_json_schema(spec, any_whitespace=False)
        if kind == "json_object":  # (an object, as OpenAI's JSON mode gives and vLLM compiles it)
            return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return self._compiler.compile_regex(spec)
        if kind == "choice":
            return self._compiler.compile_grammar(_ebnf_of_choice(json.loads(spec)))
        return self._compiler.compile_grammar(spec)

    def bitmask(self, seq_ids: list[int], grammars: list[SequenceGrammar],
                drafts: dict[int, list[int]] | None = None) -> GrammarOutput:
        """The rows of a step's bitmask, one per sequence that samples under a grammar that has not ended, and one
        more per token it proposed (drafts, by sequence: speculative decoding samples after each), filled with the
        matcher advanced through the proposals (the scheduler kept only those the grammar allows), then rolled back."""
        xgr = _xgrammar()
        drafts = drafts or {}
        live = [(seq_id, g, drafts.get(seq_id, ())) for seq_id, g in zip(seq_ids, grammars)
                if g.ready() and not g.terminated]
        mask = xgr.allocate_token_bitmask(sum(1 + len(d) for _, _, d in live), self.vocab_size)
        rows: list[int] = []
        for seq_id, grammar, proposed in live:
            matcher = grammar.matcher
            matcher.fill_next_token_bitmask(mask, len(rows))
            rows.append(seq_id)
            for token in proposed:
                if not matcher.accept_token(token):  # (valid_drafts let it through at scheduling)
                    raise AssertionError(f"sequence {seq_id}: a proposal its grammar does not allow was scheduled")
                matcher.fill_next_token_bitmask(mask, len(rows))
                rows.append(seq_id)
            if proposed:
                matcher.rollback(len(proposed))
        return GrammarOutput(rows, mask.numpy())

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
