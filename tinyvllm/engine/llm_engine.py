"""LLMEngine: requests in, RequestOutputs out, one `step()` at a time.

    add_request -> InputProcessor (tokenize, check) -> EngineCore (Scheduler -> ModelRunner -> Sampler
                -> Scheduler.update_from_output) -> OutputProcessor (detokenize, stop strings) -> RequestOutput"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from tinyvllm.config import Config, ConfigError, EngineConfig, ModelConfig, QuantizationConfig
from tinyvllm.contract import EngineCoreOutputs
from tinyvllm.engine.core_client import EngineCoreClient
from tinyvllm.engine.engine_core import EngineCore, StepCallback
from tinyvllm.engine.input_processor import InputProcessor, ProcessedInput, PromptType
from tinyvllm.engine.output_processor import OUTPUT_KINDS, OutputProcessor
from tinyvllm.model.loader import load_model_config, resolve_model_path
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


def resolve_config(config: EngineConfig) -> tuple[Config, Any]:
    """The engine's resolved Config (the model's path and architecture, device, dtype, context length) and its
    tokenizer (None with skip_tokenizer_init). Shared by LLMEngine and the launcher of several API servers, which
    starts the core for them; a bad model path or config is refused here, before anything starts."""
    model_path = resolve_model_path(config.model)
    model_config = load_model_config(model_path)
    device = config.resolve_device()
    dtype = config.resolve_dtype(model_config.dtype, device)
    limit = model_config.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > limit:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context of {limit} tokens")
    tokenizer = None if config.skip_tokenizer_init else load_tokenizer(model_path)
    if not model_config.eos_token_ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        model_config.eos_token_ids = [tokenizer.eos_token_id]
    quantization = config.resolve_quantization(model_config, device)
    if config.keeps_gguf_types(model_path, device):
        quantization = QuantizationConfig("gguf")
    max_model_len = config.max_model_len or limit
    speculative = config.resolve_speculative()
    draft = None
    if speculative is not None and speculative.method == "draft_model":
        draft = _resolve_draft(config, speculative.model, model_config, device, dtype, max_model_len)
    return Config(config, model_config, model_path, device, dtype, max_model_len, quantization, speculative,
                  draft), tokenizer


def _resolve_draft(config: EngineConfig, path: str, target: ModelConfig, device: torch.device, dtype: torch.dtype,
                   max_model_len: int) -> Config:
    """The draft model's Config (speculative decoding, method draft_model): on the target's device, in its dtype,
    for as much of the target's context as the draft's own covers (longer sequences get no proposals). Its tokens
    must be the target's: a vocabulary larger than the target's is refused (a smaller one may be the same tokenizer
    with less padding)."""
    draft_path = resolve_model_path(path)
    draft = load_model_config(draft_path)
    if draft.vocab_size > target.vocab_size:
        raise ConfigError(f"speculative_config: the draft model's vocabulary ({draft.vocab_size} tokens) is larger "
                          f"than the target's ({target.vocab_size}): a draft model must share the target's tokenizer")
    quantization = QuantizationConfig("gguf") if config.keeps_gguf_types(draft_path, device) else None
    return Config(config, draft, draft_path, device, dtype, min(max_model_len, draft.max_position_embeddings),
                  quantization)


class LLMEngine:
    def __init__(self, config: EngineConfig, core_process: bool = False, core_connection: Any = None) -> None:
        """core_process: run the engine core (scheduler, model runner) in a process of its own (the server
        does, so that its event loop and the model steps share no GIL). core_connection: use the core another
        process started (engine/core_client.start_engine_core), through this connection."""
        self.config = config
        resolved, self.tokenizer = resolve_config(config)
        self.model_path, self.model_config, self.device = resolved.model_path, resolved.model, resolved.device
        self.max_model_len = resolved.max_model_len
        self.engine_core: EngineCore | EngineCoreClient
        if core_connection is not None:
            self.engine_core = EngineCoreClient(core_connection)
        elif core_process:
            self.engine_core = EngineCoreClient.start(resolved)
        else:
            self.engine_core = EngineCore(resolved)
        self.input_processor = InputProcessor(self.tokenizer, self.model_config.vocab_size, self.max_model_len,
                                              self.engine_core.kv_capacity_tokens, config.max_n)
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
        return self.process_outputs(self.engine_core.step())

    def process_outputs(self, core_outputs: EngineCoreOutputs) -> list[RequestOutput]:
        """The RequestOutputs of the engine core's outputs (of one step or several); completions that a stop
        string ended are finished in the core."""
        outputs, stopped = self.output_processor.process(core_outputs)
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
