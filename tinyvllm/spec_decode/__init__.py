"""Speculative decoding's proposers: what guesses a decoding sequence's next tokens before the target model verifies
them (the runner's rejection sampler, worker/rejection_sampler.py). They run on the engine's side, per step, over the
sequences the scheduler is about to decode, and see only token ids."""

from tinyvllm.config import SpeculativeConfig
from tinyvllm.spec_decode.ngram_proposer import NgramProposer
from tinyvllm.spec_decode.proposer import Proposer

__all__ = ["NgramProposer", "Proposer", "make_proposer"]


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer of config.method (a draft model's would be built here too, with its own runner and KV cache)."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    raise AssertionError(f"SpeculativeConfig.parse let through method {config.method!r}")
