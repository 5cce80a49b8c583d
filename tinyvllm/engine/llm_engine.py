"""LLMEngine: requests in, RequestOutputs out, one `step()` at a time.

    add_request -> Scheduler (waiting -> running) -> ModelRunner.execute -> Sampler
                -> append token, detokenize, stop checks -> Scheduler.update -> RequestOutput"""

from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

import torch

from tinyvllm.config import ConfigError, EngineConfig, ModelConfig, check_tensor_parallel_size
from tinyvllm.distributed import ONE_GPU, TensorParallel, destroy_tensor_parallel, init_tensor_parallel
from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.engine.scheduler import Scheduler, SchedulerOutput
from tinyvllm.engine.sequence import Sequence, SequenceStatus
from tinyvllm.model.loader import build_model, load_model_config, resolve_model_path
from tinyvllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.tokenizer import IncrementalDetokenizer, load_tokenizer
from tinyvllm.worker.model_runner import ModelRunner
from tinyvllm.worker.sampler import AsyncSamplerOutput, step_seed
from tinyvllm.worker.worker import TensorParallelWorkers, free_tcp_init_method

logger = logging.getLogger(__name__)

PLACEHOLDER_TOKEN = -1  # in token_ids, for a token sampled on the GPU and not read back yet

# What step() reports for a request: everything so far, only what is new, or only the final result.
OUTPUT_KINDS = ("cumulative", "delta", "final_only")


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    output_kind: str

    @property
    def finished(self) -> bool:
        for seq in self.seqs:  # (a loop, not all(...): this runs for every request at every step)
            if not seq.is_finished:
                return False
        return True


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_path = resolve_model_path(config.model)
        self.model_config: ModelConfig = load_model_config(self.model_path)
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(self.model_config.dtype, self.device)
        limit = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context of {limit} tokens")
        self.max_model_len = config.max_model_len or limit
        self.tokenizer: Any = None if config.skip_tokenizer_init else load_tokenizer(self.model_path)
        tp, self.workers = self._start_tensor_parallel()
        try:
            model = build_model(self.model_config, self.model_path, self.device, self.dtype, self.max_model_len,
                                tp=tp)
            self.model_runner = ModelRunner(model, self.model_config, config, self.device, self.dtype,
                                            self.max_model_len, tp)
        except BaseException:
            if self.workers is not None:
                self.workers.shutdown(timeout_s=0)
                destroy_tensor_parallel()
            raise
        self.block_manager = BlockManager(self.model_runner.num_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.scheduling)
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if not self.eos_token_ids and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids = {self.tokenizer.eos_token_id}
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._rng = random.Random(config.seed)
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.async_scheduling = config.resolve_async_scheduling(self.device)
        self._in_flight: tuple[SchedulerOutput, AsyncSamplerOutput] | None = None

    def _start_tensor_parallel(self) -> tuple[TensorParallel, TensorParallelWorkers | None]:
        """With tensor_parallel_size N > 1: start ranks 1..N-1 and join their group as rank 0."""
        size = self.config.tensor_parallel_size
        if size == 1:
            return TensorParallel(), None
        check_tensor_parallel_size(self.model_config, size, self.device.type, num_gpus=size if ONE_GPU else None)
        if torch.distributed.is_initialized():
            raise ConfigError("a tensor-parallel engine is already running in this process (torch.distributed is "
                              "initialized): call its llm_engine.shutdown() first")
        init_method = free_tcp_init_method()
        workers = TensorParallelWorkers(self.config, self.model_path, self.device, self.dtype, self.max_model_len,
                                        init_method)
        try:
            return init_tensor_parallel(0, size, init_method, self.device), workers
        except BaseException:
            workers.shutdown(timeout_s=0)
            raise

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do for one rank). The engine is unusable after."""
        if self.workers is not None:
            try:
                if self.workers.all_alive():  # (a dead one would leave the others waiting in the broadcast)
                    self.model_runner.stop_workers()
            finally:
                self.workers.shutdown()
                destroy_tensor_parallel()
                self.workers = None

    # ---- requests ---------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, output_kind: str = "cumulative") -> None:
        """Queue a request. Everything is checked first: a bad request raises ValueError and leaves
        the engine as it was."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, not {type(params).__name__}")
        if output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {OUTPUT_KINDS}, not {output_kind!r}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_text, token_ids = self._tokenize(prompt)
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - len(token_ids)
        if len(token_ids) + max_tokens > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens and max_tokens is {max_tokens}: together "
                f"{len(token_ids) + max_tokens}, beyond the model's context of {self.max_model_len} tokens")
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if len(token_ids) + max_tokens > capacity:
            raise ValueError(
                f"the request needs up to {len(token_ids) + max_tokens} tokens of KV cache, but the whole "
                f"cache holds {capacity}: lower max_tokens or give the cache more memory")
        if self.tokenizer is None and params.stop_strings:
            raise ValueError("stop strings need a tokenizer, and this engine runs with skip_tokenizer_init")
        if params.max_tokens is None:
            params = _with_max_tokens(params, max_tokens)
        stop_tokens = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_tokens |= self.eos_token_ids
        stop_tokens = frozenset(t for t in stop_tokens if 0 <= t < self.model_config.vocab_size)
        now = time.time() if arrival_time is None else arrival_time
        seqs = []
        for index in range(params.n):
            seed = self._rng.getrandbits(63) if params.seed is None else step_seed(params.seed, -1 - index)
            detok = None if self.tokenizer is None else IncrementalDetokenizer(
                self.tokenizer, params.skip_special_tokens)
            seqs.append(Sequence(next(self._seq_ids), request_id, index, token_ids, params, seed, now, detok,
                                 stop_tokens))
        self.requests[request_id] = Request(request_id, prompt_text, token_ids, params, seqs,
                                            RequestMetrics(arrival_time=now), output_kind)
        for seq in seqs:
            self.scheduler.add(seq)

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; this engine runs with skip_tokenizer_init, "
                                 "so give token ids")
            token_ids = self.tokenizer.encode(prompt)
            if not token_ids:
                raise ValueError("the prompt encodes to no tokens")
            return prompt, token_ids
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            raise ValueError("a prompt is a string or a list of token ids")
        if not prompt:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
        return None, list(prompt)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks; True if it was still known."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.abort(request_id)
        for seq in request.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
            seq.status = SequenceStatus.FINISHED
            _drop_pending(seq)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step ---------------------------------------------------------------------------------
    # With async scheduling, step() launches the next batch before it waits for the one in flight, so
    # that the host's work (scheduling, building the batch, detokenizing, stop checks) overlaps the
    # GPU's. The new batch is scheduled as if the pending tokens were known (placeholders, which the
    # model runner takes from the GPU); a sequence that turns out to have stopped at its pending token
    # has computed one token in vain, which is dropped. Each call returns one step's outputs.
    def step(self) -> list[RequestOutput]:
        if self.workers is not None:
            self.workers.check_alive()
            try:
                return self._step()
            except RuntimeError:
                self.workers.check_alive()  # a worker that died mid-step is the error to report
                raise
        return self._step()

    def _step(self) -> list[RequestOutput]:
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            in_flight = self._launch(None)
            if in_flight is None:
                if self.scheduler.has_unfinished():
                    raise RuntimeError("the scheduler has waiting requests but could schedule none")
                return []
        if self.async_scheduling and not in_flight[1].has_penalties:  # penalties need the tokens on the host
            self._in_flight = self._launch(in_flight[1])
        return self._process(*in_flight)

    def _launch(self, prev: AsyncSamplerOutput | None) -> tuple[SchedulerOutput, AsyncSamplerOutput] | None:
        """Schedule a batch and start it on the device; None if nothing can run now."""
        batch = self.scheduler.schedule()
        if batch.is_empty():
            return None
        now = time.time()
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            if seq.num_computed_tokens >= seq.num_prompt_tokens:
                continue  # a decode: both figures below change only while a prompt is computed
            metrics = self.requests[seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
            self.num_prompt_tokens += max(0, min(seq.num_prompt_tokens, seq.num_computed_tokens + num_new)
                                          - seq.num_computed_tokens)
        result = self.model_runner.execute(batch, prev)
        self.scheduler.advance(batch)
        for seq in result.seqs:
            seq.token_ids.append(PLACEHOLDER_TOKEN)
            seq.num_pending += 1
        return batch, result

    def _process(self, batch: SchedulerOutput, pending: AsyncSamplerOutput) -> list[RequestOutput]:
        """Wait for a launched step's tokens and turn them into outputs."""
        result = pending.get()
        now = time.time()
        touched: dict[str, Request] = {}
        for seq, token, logprobs in zip(result.seqs, result.token_ids, result.logprobs):
            if seq.is_finished:  # it stopped at its previous token, or was aborted: the token is dropped
                continue
            # The step's placeholder is the first still pending (a later step may have added one more).
            seq.token_ids[len(seq.token_ids) - seq.num_pending] = token
            seq.num_pending -= 1
            self._append_token(seq, token, logprobs)
            if seq.is_finished:
                _drop_pending(seq)
            request = self.requests[seq.request_id]
            metrics = request.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
                metrics.num_cached_tokens = seq.num_cached_tokens
            metrics.last_token_time = now
            touched[seq.request_id] = request
            self.num_generation_tokens += 1
        self.scheduler.update(batch)
        outputs = []
        for request in touched.values():
            finished = request.finished
            if finished:
                request.metrics.finished_time = now
                del self.requests[request.request_id]
            if finished or request.output_kind != "final_only":
                outputs.append(self._make_output(request, finished))
        return outputs

    def _append_token(self, seq: Sequence, token: int, logprobs: dict[int, Logprob] | None) -> None:
        """Account for seq's new token (already in token_ids): logprobs, text, stop conditions."""
        if logprobs is not None:
            if self.tokenizer is not None:
                for token_id, lp in logprobs.items():
                    lp.decoded_token = self.tokenizer.decode([token_id])
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs[token].logprob
        params = seq.params
        text_before = len(seq.output_text)
        if seq.detokenizer is not None:
            seq.detokenizer.add(token)
            seq.output_text = seq.detokenizer.text
        num_outputs = seq.num_output_tokens - seq.num_pending  # this token's number (later ones may be pending)
        may_stop = num_outputs >= params.min_tokens
        if may_stop and token in seq.stop_token_set:
            self._finish(seq, "stop", None if token in self.eos_token_ids and not params.ignore_eos else token)
        elif may_stop and params.stop_strings and self._truncate_at_stop(seq, text_before):
            return
        elif num_outputs >= params.max_tokens or seq.num_prompt_tokens + num_outputs >= self.max_model_len:
            self._finish(seq, "length", None)

    def _truncate_at_stop(self, seq: Sequence, text_before: int) -> bool:
        """If a stop string appeared in the new text, cut the output there (keeping the stop string
        only if asked) and finish."""
        for stop in seq.params.stop_strings:
            index = seq.output_text.find(stop, max(0, text_before - len(stop) + 1))
            if index >= 0:
                end = index + len(stop) if seq.params.include_stop_str_in_output else index
                seq.output_text = seq.output_text[:end]
                seq.finish_reason, seq.stop_reason = "stop", stop
                seq.status = SequenceStatus.FINISHED
                return True
        return False

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        if seq.detokenizer is not None:
            seq.detokenizer.flush()
            seq.output_text = seq.detokenizer.text
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        seq.status = SequenceStatus.FINISHED

    def _make_output(self, request: Request, finished: bool) -> RequestOutput:
        delta = request.output_kind == "delta"
        completions = []
        for seq in request.seqs:
            text = _visible_text(seq)
            tokens = seq.output_token_ids
            logprobs = seq.logprobs if seq.params.logprobs is not None else None
            if delta:
                text = text[seq.reported_text_len:]
                tokens = tokens[seq.num_reported_tokens:]
                logprobs = logprobs[seq.num_reported_tokens:] if logprobs is not None else None
                seq.reported_text_len += len(text)
                seq.num_reported_tokens += len(tokens)
            completions.append(CompletionOutput(seq.index, text, tokens, seq.finish_reason, seq.stop_reason,
                                                logprobs, seq.cumulative_logprob if logprobs is not None else None))
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions,
                             finished, request.metrics, request.metrics.num_cached_tokens)

    # ---- introspection ----------------------------------------------------------------------------
    def get_stats(self) -> dict[str, float]:
        bm = self.block_manager
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": bm.usage,
            "num_free_blocks": bm.num_free_blocks,
            "num_blocks": bm.num_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens": self.num_prompt_tokens,
            "generation_tokens": self.num_generation_tokens,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
        }


def _drop_pending(seq: Sequence) -> None:
    """A finished sequence's placeholders go: the tokens a step in flight draws for it are dropped."""
    if seq.num_pending:
        del seq.token_ids[-seq.num_pending:]
        seq.num_pending = 0


def _visible_text(seq: Sequence) -> str:
    """While a sequence runs, hold back a tail that could be the start of a stop string, so that
    streamed text never has to be taken back."""
    if seq.is_finished or not seq.params.stop_strings:
        return seq.output_text
    hold = max(len(s) for s in seq.params.stop_strings) - 1
    return seq.output_text[: max(len(seq.output_text) - hold, seq.reported_text_len)]


def _with_max_tokens(params: SamplingParams, max_tokens: int) -> SamplingParams:
    import dataclasses

    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init}
    return SamplingParams(**{**fields, "max_tokens": max_tokens})
