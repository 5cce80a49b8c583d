"""The offline API: LLM(model).generate(prompts, SamplingParams(...)) as in vLLM."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tinyvllm.config import EngineConfig
from tinyvllm.engine.input_processor import Message, PromptType
from tinyvllm.engine.llm_engine import LLMEngine
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import SamplingParams

Prompt = PromptType


class LLM:
    """An engine for offline batched generation. `model=None` runs the embedded SmolLM2-135M-Instruct."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.llm_engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))
        self._request_ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generates for every prompt (a string, a list of token ids, or {"prompt_token_ids": [...]});
        outputs come back in the prompts' order."""
        prompts = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        return self._run(prompts, params_list, use_tqdm)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or several; the model's chat template
        turns each into a prompt."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt, chat_template) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: list[Message], add_generation_prompt: bool = True,
                            chat_template: str | None = None) -> list[int]:
        return self.llm_engine.input_processor.apply_chat_template(conversation, add_generation_prompt,
                                                                  chat_template)

    def _run(self, prompts: list[Prompt], params_list: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = []
        try:
            for prompt, params in zip(prompts, params_list):
                request_id = str(next(self._request_ids))
                engine.add_request(request_id, prompt, params, output_kind="final_only")
                ids.append(request_id)
        except Exception:
            for request_id in ids:  # a bad prompt leaves nothing of its batch behind
                engine.abort_request(request_id)
            raise
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(prompts) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(prompts), desc="Processed prompts", dynamic_ncols=True)
        try:
            while len(finished) < len(ids):
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for request_id in ids:
                engine.abort_request(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[i] for i in ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    return prompts
