"""Speculative decoding's proposers: what guesses a decoding sequence's next tokens before the target model verifies
them (the runner's rejection sampler, worker/rejection_sampler.py). They run on the engine's side, per step, over the
sequences the scheduler is about to decode, and see only token ids."""

from __future__ import annotations

import dataclasses

from tinyvllm.config import Config, SpeculativeConfig
from tinyvllm.model.interface import CausalLM
from tinyvllm.spec_decode.draft_model import DraftModelProposer
from tinyvllm.spec_decode.ngram_proposer import NgramProposer
from tinyvllm.spec_decode.proposer import Proposer
from tinyvllm.worker.model_runner import ModelRunner

__all__ = ["DraftModelProposer", "NgramProposer", "Proposer", "make_proposer"]


def make_proposer(config: SpeculativeConfig, draft_model: CausalLM | None = None, draft: Config | None = None,
                  num_blocks: int = 0) -> Proposer:
    """The proposer of config.method. draft_model: the draft model's, loaded (as `draft` says), given a runner with
    a KV cache of num_blocks blocks (the target's count: it never holds more tokens than the target)."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "draft_model" and draft_model is not None and draft is not None:
        engine = dataclasses.replace(draft.engine, num_kv_blocks=num_blocks, speculative_config=None,
                                     cascade_attention=False)  # (no two of its sequences share a block)
        runner = ModelRunner(draft_model, dataclasses.replace(draft, engine=engine))
        return DraftModelProposer(runner, draft.max_model_len, engine.max_num_batched_tokens)
    raise AssertionError(f"speculative_config method {config.method!r} without what it needs")
