"""LLMEngine: requests in, RequestOutputs out, one `step()` at a time.

    add_request -> InputProcessor (tokenize, check) -> EngineCore (Scheduler -> ModelRunner -> Sampler
                -> Scheduler.update_from_output) -> OutputProcessor (detokenize, stop strings) -> RequestOutput"""

from __future__ import annotations

import logging
import time
from typing import Any

from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.engine.core_client import EngineCoreClient
from tinyvllm.engine.engine_core import EngineCore, StepCallback
from tinyvllm.engine.input_processor import InputProcessor, ProcessedInput, PromptType
from tinyvllm.engine.output_processor import OUTPUT_KINDS, OutputProcessor
from tinyvllm.model.loader import load_model_config, resolve_model_path
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, core_process: bool = False) -> None:
        """core_process: run the engine core (scheduler, model runner) in a process of its own (the server
        does, so that its event loop and the model steps share no GIL)."""
        self.config = config
        self.model_path = resolve_model_path(config.model)
        self.model_config: ModelConfig = load_model_config(self.model_path)
        self.device = config.resolve_device()
        dtype = config.resolve_dtype(self.model_config.dtype, self.device)
        limit = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context of {limit} tokens")
        self.max_model_len = config.max_model_len or limit
        self.tokenizer: Any = None if config.skip_tokenizer_init else load_tokenizer(self.model_path)
        tokenizer_eos = None if self.tokenizer is None else self.tokenizer.eos_token_id
        if not self.model_config.eos_token_ids and tokenizer_eos is not None:
            self.model_config.eos_token_ids = [tokenizer_eos]
        core_class = EngineCoreClient if core_process else EngineCore
        self.engine_core = core_class(config, self.model_config, self.model_path, self.device, dtype,
                                      self.max_model_len)
        self.input_processor = InputProcessor(self.tokenizer, self.model_config.vocab_size, self.max_model_len,
                                              self.engine_core.kv_capacity_tokens)
        self.output_processor = OutputProcessor(self.tokenizer)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do for one rank). The engine is unusable after."""
        self.engine_core.shutdown()

    # ---- requests ---------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, output_kind: str = "cumulative") -> None:
        """Queue a request. Everything is checked first: a bad request raises ValueError (InputError) and
        leaves the engine as it was."""
        processed = self.input_processor.process(prompt, params if params is not None else SamplingParams())
        self.add_processed_request(request_id, processed, arrival_time, output_kind)

    def add_processed_request(self, request_id: str, processed: ProcessedInput, arrival_time: float | None = None,
                              output_kind: str = "cumulative") -> None:
        """Queue a request that an input processor has already checked (the server's, on its own thread)."""
        if output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {OUTPUT_KINDS}, not {output_kind!r}")
        if request_id in self.output_processor.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        now = time.time() if arrival_time is None else arrival_time
        self.output_processor.add_request(request_id, processed.prompt, processed.prompt_token_ids, processed.params,
                                          output_kind, now)
        self.engine_core.add_request(request_id, processed.prompt_token_ids, processed.params)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks; True if it was still unfinished."""
        known = self.output_processor.abort_request(request_id)
        self.engine_core.abort_request(request_id)
        return known

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.requests)

    # ---- one step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step (with async scheduling: launch the next and finish the one in flight); the outputs
        of the requests that got new tokens."""
        outputs, stopped = self.output_processor.process(self.engine_core.step())
        for request_id, index, stop in stopped:
            self.engine_core.finish_sequence(request_id, index, "stop", stop)
        return outputs

    # ---- observing --------------------------------------------------------------------------------
    def add_step_callback(self, callback: StepCallback, record_gpu_time: bool = False) -> None:
        """Call `callback(StepStats)` after every step (record_gpu_time: with its device time, which costs a
        CUDA event pair per step)."""
        if isinstance(self.engine_core, EngineCoreClient):
            raise ValueError("step callbacks need the engine core in this process (core_process=False)")
        self.engine_core.step_callbacks.append(callback)
        self.engine_core.record_gpu_time |= record_gpu_time

    def get_stats(self) -> dict[str, float]:
        return self.engine_core.get_stats()
