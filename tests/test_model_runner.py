"""The model runner's own order of a step's sequences: a mixed step runs its one-token sequences first (attention
sends them to the decode kernel as one block, AttentionMetadata.num_decodes), and every sampled token still goes
to its own sequence. And its plan of a step: the one path each shape takes."""

from __future__ import annotations

from tests.utils import tiny_llama_fixture, tiny_llm
from tinyvllm.contract import NewSequence, SchedulerOutput
from tinyvllm.ops import AttentionMetadata
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.worker.model_runner import ModelInput, Path, StepPlan, padded_num_tokens
from tinyvllm.worker.sampler import SamplingTensors

PROMPTS = {1: [5, 9, 2, 7, 3, 8], 2: [4, 4, 1, 6], 3: [2, 3, 5]}
checkpoint = tiny_llama_fixture(seed=5)


def _new(seq_id: int) -> NewSequence:
    return NewSequence(seq_id, PROMPTS[seq_id], len(PROMPTS[seq_id]), 0, [seq_id], SamplingParams(temperature=0),
                       0, ())


def _mixed_step(checkpoint: str, decodes_last: bool) -> tuple[dict[int, int], AttentionMetadata]:
    """Sequences 2 and 3 prefill, then one step decodes them beside sequence 1's prompt, sent first (as a
    scheduler may send it) or last. Returns each sequence's token from that step, and the step's metadata."""
    runner = tiny_llm(checkpoint, num_kv_blocks=16, block_size=16).llm_engine.engine_core.model_runner
    runner.execute_model(SchedulerOutput([2, 3], [4, 3], [_new(2), _new(3)]))
    runner.sample_tokens().get()
    metas: list[AttentionMetadata] = []
    prepare = runner.prepare

    def recording_prepare(step: SchedulerOutput) -> ModelInput:
        inputs = prepare(step)
        metas.append(inputs.meta)
        return inputs

    runner.prepare = recording_prepare
    order = [1, 2, 3] if decodes_last else [2, 3, 1]
    runner.execute_model(SchedulerOutput(order, [6 if i == 1 else 1 for i in order], [_new(1)]))
    out = runner.sample_tokens().get()
    return dict(zip(out.seq_ids, (tokens for (tokens,) in out.sampled_token_ids))), metas[0]


def test_mixed_step_runs_its_decodes_first(checkpoint: str) -> None:
    tokens_last, meta = _mixed_step(checkpoint, decodes_last=True)
    assert meta.num_decodes == 2
    assert meta.cu_query_lens.tolist() == [0, 1, 2, 8]
    assert meta.context_lens.tolist() == [5, 4, 6]  # sequences 2 and 3 (prompt + their first token), then 1
    tokens_first, meta = _mixed_step(checkpoint, decodes_last=False)
    assert meta.num_decodes == 2 and meta.cu_query_lens.tolist() == [0, 1, 2, 8]
    assert tokens_last == tokens_first and sorted(tokens_last) == [1, 2, 3]


def test_each_sequence_gets_its_own_token(checkpoint: str) -> None:
    """The mixed step's tokens equal those of each sequence run alone (greedy, same prompts)."""
    tokens, _ = _mixed_step(checkpoint, decodes_last=True)
    llm = tiny_llm(checkpoint, num_kv_blocks=16, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    alone = {i: llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids
             for i, p in PROMPTS.items()}
    assert tokens[1] == alone[1][0]
    assert tokens[2] == alone[2][1] and tokens[3] == alone[3][1]


class _DecodeGraphs:
    """Stands in for CudaGraphs (CUDA only): graphs of 4 and 8 sequences, each with a greedy tail."""

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= 8

    def batch_size(self, num_seqs: int) -> int:
        return 4 if num_seqs <= 4 else 8

    def tail_mode(self, sampling: SamplingTensors) -> str | None:
        return "greedy" if sampling.all_greedy else None


class _PiecewiseGraphs:
    """Stands in for PiecewiseCudaGraphs: pieces up to 512 tokens, whole graphs of one sequence up to 256."""

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= 512

    def fits_whole(self, num_seqs: int, num_tokens: int) -> bool:
        return num_seqs == 1 and num_tokens <= 256


def test_each_step_shape_has_one_plan(checkpoint: str) -> None:
    llm = tiny_llm(checkpoint, num_kv_blocks=16, block_size=16, max_num_batched_tokens=8192)
    runner = llm.llm_engine.engine_core.model_runner
    assert runner.plan(3, 3) == StepPlan(Path.EAGER, 3)  # the CPU: every step eager, as it is
    assert runner.plan(2, 3000) == StepPlan(Path.EAGER, 3000)
    runner.cuda_graphs, runner.piecewise_graphs, runner.fixed_shapes = _DecodeGraphs(), _PiecewiseGraphs(), True
    greedy = SamplingTensors.greedy()
    assert runner.plan(3, 3, greedy) == StepPlan(Path.DECODE_GRAPH, 3, graph_size=4, tail="greedy")
    assert runner.plan(3, 3, None, shared_prefix=True) == StepPlan(Path.DECODE_GRAPH, 3, 4, shared_prefix=True)
    assert runner.plan(1, 1, greedy).path is Path.DECODE_GRAPH  # (not the whole graph of one sequence's tokens)
    assert runner.plan(9, 9, greedy) == StepPlan(Path.PIECEWISE, 9)  # more than the decode graphs hold
    assert runner.plan(1, 200) == StepPlan(Path.WHOLE_GRAPH, 200)
    assert runner.plan(1, 300) == StepPlan(Path.PIECEWISE, 300)
    assert runner.plan(2, 200) == StepPlan(Path.PIECEWISE, 200)
    assert runner.plan(2, 3000) == StepPlan(Path.EAGER, padded_num_tokens(3000, 8192))
    assert padded_num_tokens(3000, 8192) == 3072
