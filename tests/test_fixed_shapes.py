"""On CUDA the model runner pads the LM head's rows and large steps' tokens to a fixed set of shapes (each
new cuBLAS shape costs a heuristic query and may wait for the device). The padding must not change a
token: here it is forced on the CPU, with small thresholds so that a tiny model's steps reach it."""

from __future__ import annotations

import random

import pytest

from tests.utils import tiny_llama_fixture, tiny_llm
from tinyvllm import SamplingParams
from tinyvllm.worker import model_runner
from tinyvllm.worker.cuda_graphs import WHOLE_GRAPH_MAX_TOKENS, graph_token_counts, size_ladder
from tinyvllm.worker.model_runner import padded_num_tokens

checkpoint = tiny_llama_fixture(seed=11)


def test_the_logits_ladder_covers_every_row_count_with_little_padding() -> None:
    ladder = size_ladder(256)
    assert ladder[:5] == [1, 2, 4, 8, 16] and ladder[-1] == 256
    for n in range(1, 257):
        rows = next(r for r in ladder if r >= n)
        assert rows - n < 16
    assert size_ladder(5) == [1, 2, 4, 5]


def test_whole_graphs_stop_at_the_tokens_a_block_table_holds() -> None:
    # (on the GPU a whole graph past the table read out of it: the engine died at start with max_model_len 1,024)
    counts, whole = graph_token_counts(8192, 64 * 16)  # max_model_len 1,024 in blocks of 16
    assert counts[0] == 64 and counts[-1] == 8192 and whole == [t for t in counts if t <= 1024]
    assert graph_token_counts(8192, 63 * 16)[1][-1] == 896  # max_model_len 1,000: 1,024 would pass its 1,008
    assert graph_token_counts(8192, 4096 * 16)[1][-1] == WHOLE_GRAPH_MAX_TOKENS
    assert graph_token_counts(300, 4096 * 16) == ([64, 128, 192, 256, 300], [64, 128, 192, 256, 300])
    assert graph_token_counts(8192, 0)[1] == []


def test_large_steps_are_padded_to_a_multiple_and_never_past_the_budget() -> None:
    assert padded_num_tokens(2048, 8192) == 2048  # (the graphs' range: left as it is)
    assert padded_num_tokens(2049, 8192) == 2304
    assert padded_num_tokens(8192, 8192) == 8192
    assert padded_num_tokens(8100, 8150) == 8150  # rounded up, but not past max_num_batched_tokens
    assert padded_num_tokens(8190, 8150) == 8190  # (and never below the step itself)
    assert padded_num_tokens(9000, 65536) == 9216  # above the warmed-up sizes: a sixteenth of 16384
    assert padded_num_tokens(40000, 65536) == 40960


def _run(checkpoint: str, fixed: bool, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    llm = tiny_llm(checkpoint, max_num_seqs=8, max_num_batched_tokens=96, max_model_len=256)
    runner = llm.llm_engine.engine_core.model_runner
    if fixed:
        monkeypatch.setattr(model_runner, "EAGER_PADDING_ABOVE", 8)
        monkeypatch.setattr(model_runner, "EAGER_TOKEN_MULTIPLE", 32)
        runner.fixed_shapes = True
        runner.warm_up_shapes()  # (it runs on the CPU too: here it checks that every padded size runs)
    rng = random.Random(0)
    prompts = [[rng.randrange(100) for _ in range(rng.randrange(3, 60))] for _ in range(12)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_padding_changes_no_token(checkpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    plain = _run(checkpoint, False, monkeypatch)
    padded = []
    calls = []
    real_forward = None

    def spy(self, input_ids, positions, meta):  # noqa: ANN001, ANN202
        calls.append((input_ids.shape[0], int(meta.cu_query_lens[-1]), int((meta.slot_mapping < 0).sum())))
        return real_forward(self, input_ids, positions, meta)

    from tinyvllm.model.llama import LlamaForCausalLM

    real_forward = LlamaForCausalLM.forward
    monkeypatch.setattr(LlamaForCausalLM, "forward", spy)
    padded = _run(checkpoint, True, monkeypatch)
    assert padded == plain
    steps = [c for c in calls if c[1] > 1]  # (the warm-up's have no real token: cu_query_lens is [0])
    assert any(tokens > real for tokens, real, _ in steps), "no step was padded: the test does not test"
    for tokens, real, no_slot in steps:
        assert tokens == padded_num_tokens(real, 96) and no_slot >= tokens - real
