"""EngineCore: the scheduler and the model runner, stepping together. Token ids in, EngineCoreOutputs
(each sequence's new token, and whether it finished it) out. It makes no text and holds no tokenizer:
that is the output processor's work, so that the core can run apart from the code that serves requests.

With async scheduling, step() launches the next batch before it waits for the one in flight, so that the
host's work (scheduling, building the batch, processing outputs) overlaps the device's. The new batch is
scheduled as if the tokens in flight were known (placeholders, which the model runner takes from the
device); a sequence that turns out to have stopped at its token in flight has computed one token in
vain, which is dropped.

A step with sequences under a grammar (structured output) is launched before the step in flight is read back, but
sampled only after: its bitmask needs the tokens that step draws. The device runs the new step's forward pass
meanwhile, as vLLM V1 overlaps it."""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tinyvllm.config import Config, ConfigError, check_tensor_parallel_size
from tinyvllm.contract import EngineCoreOutputs, SchedulerOutput, SequenceError, StepStats
from tinyvllm.distributed import ONE_GPU, TensorParallel, destroy_tensor_parallel, init_tensor_parallel
from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.engine.scheduler import Scheduler
from tinyvllm.engine.sequence import Sequence
from tinyvllm.engine.structured_output import SequenceGrammar, StructuredOutputManager
from tinyvllm.model.loader import build_model, return_freed_memory
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.spec_decode import make_proposer
from tinyvllm.tokenizer import load_tokenizer
from tinyvllm.worker.kv_cache import kv_cache_bytes_per_block
from tinyvllm.worker.model_runner import ModelRunner
from tinyvllm.worker.sampler import AsyncModelRunnerOutput, step_seed
from tinyvllm.worker.tp_worker import TensorParallelWorkers, free_tcp_init_method

logger = logging.getLogger(__name__)

StepCallback = Callable[[StepStats], None]


@dataclass
class _Launched:
    """A step on the device: what was scheduled, its output on its way, and its statistics so far."""

    step: SchedulerOutput
    output: AsyncModelRunnerOutput | None  # (None: not sampled yet, its grammar waiting for the step before)
    stats: StepStats | None  # only when someone watches


class EngineCore:
    def __init__(self, resolved: Config) -> None:
        self.config = config = resolved.engine
        self.model_config = model_config = resolved.model
        self.device = device = resolved.device
        tp, self.workers = self._start_tensor_parallel(resolved)
        try:
            # (a draft model loads first: its weights and its KV cache, block for block the target's, count in the
            # target's pool sizing)
            draft = resolved.draft
            draft_model = None if draft is None else build_model(draft.model, draft.model_path, device, draft.dtype,
                                                                 draft.max_model_len, quantization=draft.quantization)
            draft_bytes = 0 if draft_model is None else kv_cache_bytes_per_block(
                draft_model, config.block_size, config.resolve_kv_cache_dtype(draft.dtype))
            model = build_model(model_config, resolved.model_path, device, resolved.dtype, resolved.max_model_len,
                                tp=tp, quantization=resolved.quantization)
            self.model_runner = ModelRunner(model, resolved, tp, draft_bytes)
        except BaseException:
            if self.workers is not None:
                self.workers.shutdown(timeout_s=0)
                destroy_tensor_parallel()
            raise
        self.block_manager = BlockManager(self.model_runner.num_blocks, config.block_size,
                                          config.enable_prefix_caching, model.sliding_window)
        speculative = resolved.speculative
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   resolved.max_model_len, config.scheduling,
                                   proposer=make_proposer(speculative, draft_model, draft,
                                                          self.model_runner.num_blocks) if speculative else None,
                                   num_speculative_tokens=speculative.num_speculative_tokens if speculative else 0)
        self.eos_token_ids = frozenset(model_config.eos_token_ids)
        self.structured_output = StructuredOutputManager(lambda: load_tokenizer(resolved.model_path),
                                                         model_config.vocab_size)
        self._compiling: list[tuple[str, SequenceGrammar]] = []  # requests whose grammar is compiling
        self.requests: dict[str, list[Sequence]] = {}
        self._errors: dict[str, str] = {}  # requests failed since the last outputs (EngineCoreOutputs.errors)
        self._seq_ids = itertools.count()
        self._rng = random.Random(config.seed)
        self.async_scheduling = config.resolve_async_scheduling(device)
        self._in_flight: _Launched | None = None
        self.step_callbacks: list[StepCallback] = []
        self.record_gpu_time = False  # time each step on the device for the step callbacks (costs a sync)
        self.num_generation_tokens = 0
        if device.type == "cpu":  # (what building the engine allocated and freed: the process's memory after load)
            return_freed_memory()

    def _start_tensor_parallel(self, resolved: Config) -> tuple[TensorParallel, TensorParallelWorkers | None]:
        """With tensor_parallel_size N > 1: start ranks 1..N-1 and join their group as rank 0."""
        size = self.config.tensor_parallel_size
        if size == 1:
            return TensorParallel(), None
        check_tensor_parallel_size(self.model_config, size, self.device.type, num_gpus=size if ONE_GPU else None)
        if torch.distributed.is_initialized():
            raise ConfigError("a tensor-parallel engine is already running in this process (torch.distributed is "
                              "initialized): call its llm_engine.shutdown() first")
        init_method = free_tcp_init_method()
        workers = TensorParallelWorkers(resolved, init_method)
        try:
            return init_tensor_parallel(0, size, init_method, self.device), workers
        except BaseException:
            workers.shutdown(timeout_s=0)
            raise

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do for one rank). The core is unusable after."""
        self.structured_output.shutdown()
        if self.workers is not None:
            try:
                if self.workers.all_alive():  # (a dead one would leave the others waiting in the broadcast)
                    self.model_runner.stop_workers()
            finally:
                self.workers.shutdown()
                destroy_tensor_parallel()
                self.workers = None

    @property
    def kv_capacity_tokens(self) -> int:
        """The most tokens (prompt and output) one request may hold in the KV cache: the pool's; or, where every layer
        attends within a sliding window and the pool holds the most one sequence keeps at once
        (BlockManager.most_tokens_held: the scheduler gives back the blocks that fell out of the window), any length
        the model takes."""
        bm = self.block_manager
        pool = bm.num_blocks * bm.block_size
        held = bm.most_tokens_held(self.scheduler.max_num_batched_tokens)
        return max(pool, self.scheduler.max_model_len) if held is not None and held <= pool else pool

    # ---- requests ---------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request already validated (by the input processor): one sequence per completion (n)."""
        stop_tokens = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_tokens |= self.eos_token_ids
        stop_tokens = frozenset(t for t in stop_tokens if 0 <= t < self.model_config.vocab_size)
        seqs = []
        for index in range(params.n):
            seed = self._rng.getrandbits(63) if params.seed is None else step_seed(params.seed, -1 - index)
            seqs.append(Sequence(next(self._seq_ids), request_id, index, prompt_token_ids, params, seed, stop_tokens,
                                 self.eos_token_ids))
        if params.structured_outputs is not None:
            grammar = self.structured_output.grammar(params.structured_outputs)
            for seq in seqs:
                seq.grammar = grammar if seq.index == 0 else self.structured_output.share(grammar)
            self._compiling.append((request_id, grammar))
        self.requests[request_id] = seqs  # (only now, when nothing more can fail)
        for seq in seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Finish every sequence of the request and free its KV blocks (nothing if it is unknown)."""
        for seq in self.requests.pop(request_id, []):
            self.scheduler.finish(seq, "abort")

    def fail_request(self, request_id: str, message: str) -> None:
        """End a request the engine could not serve (an error while taking it in, or in a step, that concerns it
        alone): its unfinished completions end with finish_reason "error", and the next outputs say why
        (EngineCoreOutputs.errors). The core goes on serving the others."""
        for seq in self.requests.pop(request_id, []):
            self.scheduler.finish(seq, "error")
        self._errors[request_id] = message

    def finish_sequence(self, request_id: str, index: int, reason: str, stop_reason: int | str | None) -> None:
        """End one completion early (the output processor found a stop string in its text)."""
        seqs = self.requests.get(request_id)
        if seqs is not None:
            self.scheduler.finish(seqs[index], reason, stop_reason)
            self._forget_if_done(request_id)

    def _forget_if_done(self, request_id: str) -> None:
        seqs = self.requests.get(request_id)
        if seqs is not None and all(s.is_finished for s in seqs):
            del self.requests[request_id]

    def _check_compiling(self) -> None:
        """Forget the grammars that compiled; fail the requests whose grammar did not."""
        compiling = []
        for request_id, grammar in self._compiling:
            if not grammar.compiled.done():
                compiling.append((request_id, grammar))
            elif grammar.failed is not None and request_id in self.requests:
                self.fail_request(request_id, f"its structured output did not compile: {grammar.failed}")
        self._compiling = compiling

    def has_unfinished_requests(self) -> bool:
        """Requests to step, or failures not reported yet."""
        return bool(self.requests or self._errors)

    @property
    def has_step_in_flight(self) -> bool:
        """A step launched and not yet read back (async scheduling)."""
        return self._in_flight is not None

    # ---- one step ---------------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        if self.workers is not None:
            self.workers.check_alive()
            try:
                return self._step()
            except RuntimeError:
                self.workers.check_alive()  # a worker that died mid-step is the error to report
                raise
        return self._step()

    def _step(self) -> EngineCoreOutputs:
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            in_flight = self._launch()
            if in_flight is None:
                if self._compiling:  # (what waits, waits for its grammar)
                    concurrent.futures.wait([g.compiled for _, g in self._compiling], timeout=0.05,
                                            return_when=concurrent.futures.FIRST_COMPLETED)
                elif self.scheduler.has_unfinished():
                    raise RuntimeError("the scheduler has waiting requests but could schedule none")
                return self._with_errors(EngineCoreOutputs())
        # (penalties need the tokens on the host; a verification's accepted count decides the next step's positions;
        # proposals for the next step need the tokens in flight)
        if self.async_scheduling and not in_flight.output.has_penalties \
                and not in_flight.step.scheduled_spec_decode_tokens and not self.scheduler.speculation_ready():
            self._in_flight = self._launch(sample=False)
        start = time.perf_counter()
        result = in_flight.output.get()
        waited = time.perf_counter()
        outputs = self.scheduler.update_from_output(in_flight.step, result)
        if self._in_flight is not None and self._in_flight.output is None:  # (its grammar's tokens are known now)
            self._in_flight.output = self._sample(self._in_flight.step)
        for entry in outputs.finished:
            self._forget_if_done(outputs.request_ids[entry])
        self.num_generation_tokens += len(outputs)
        stats = in_flight.stats
        if stats is not None:
            stats.wait_ms, stats.update_ms = (waited - start) * 1e3, (time.perf_counter() - waited) * 1e3
            stats.gpu_ms = result.gpu_time_ms
            for callback in self.step_callbacks:
                callback(stats)
        return self._with_errors(outputs) if self._errors else outputs

    def _with_errors(self, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        outputs.errors, self._errors = self._errors, {}
        return outputs

    def _launch(self, sample: bool = True) -> _Launched | None:
        """Schedule a batch and start it on the device; None if nothing can run now. A sequence the runner refuses
        (SequenceError) fails its request alone: the step is undone and the rest scheduled again. sample=False: a
        step with sequences under a grammar is left to sample (_sample) once the step in flight is read back."""
        start = time.perf_counter()
        if self._compiling:
            self._check_compiling()
        scheduler = self.scheduler
        preemptions, prompt_tokens = scheduler.num_preemptions, scheduler.num_prompt_tokens
        while True:
            step = scheduler.schedule()
            if step.is_empty():
                return None
            scheduled = time.perf_counter()
            try:
                self.model_runner.execute_model(step, self.record_gpu_time)
                break
            except SequenceError as e:
                seq = scheduler.seqs.get(e.seq_id)
                logger.exception("the model runner refused a sequence of request %r",
                                 seq.request_id if seq else None)
                scheduler.unschedule(step)
                if seq is not None:
                    self.fail_request(seq.request_id, e.message)
        output = self._sample(step) if sample or not step.structured_seq_ids else None
        scheduler.cache_launched()
        stats = None
        if self.step_callbacks:
            launched = time.perf_counter()
            num_prefill = scheduler.num_prompt_tokens - prompt_tokens
            seqs = scheduler.seqs
            # (Its last input is in flight: the step computes a token that is not read back yet; proposals aside.)
            drafts = step.scheduled_spec_decode_tokens
            in_flight = sum(1 for i in step.seq_ids
                            if seqs[i].num_computed_tokens - len(drafts.get(i, ())) > len(seqs[i].token_ids))
            bm = self.block_manager
            stats = StepStats(len(step.seq_ids), num_prefill, step.num_batched_tokens - num_prefill, in_flight,
                              len(scheduler.running), len(scheduler.waiting), bm.num_blocks - bm.num_free_blocks,
                              bm.num_blocks, scheduler.num_preemptions - preemptions, (scheduled - start) * 1e3,
                              (launched - scheduled) * 1e3)
        return _Launched(step, output, stats)

    def _sample(self, step: SchedulerOutput) -> AsyncModelRunnerOutput:
        """Sample the step execute_model launched, under its sequences' grammars (their bitmask, filled now)."""
        grammar = None
        if step.structured_seq_ids:
            seqs = [self.scheduler.seqs.get(i) for i in step.structured_seq_ids]
            live = [s for s in seqs if s is not None and s.grammar is not None]
            grammar = self.structured_output.bitmask([s.seq_id for s in live], [s.grammar for s in live],
                                                     step.scheduled_spec_decode_tokens)
        return self.model_runner.sample_tokens(grammar)

    def get_stats(self) -> dict[str, float]:
        bm = self.block_manager
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": bm.usage,
            "num_free_blocks": bm.num_free_blocks,
            "num_blocks": bm.num_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens": self.scheduler.num_prompt_tokens,
            "generation_tokens": self.num_generation_tokens,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "spec_decode_num_drafts": self.scheduler.num_drafts,
            "spec_decode_num_draft_tokens": self.scheduler.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.scheduler.num_accepted_tokens,
        }
