"""The model runner's own order of a step's sequences: a mixed step runs its one-token sequences first (attention
sends them to the decode kernel as one block, AttentionMetadata.num_decodes), and every sampled token still goes
to its own sequence."""

from __future__ import annotations

from tests.utils import tiny_llama_fixture, tiny_llm
from tinyvllm.contract import NewSequence, SchedulerOutput
from tinyvllm.ops import AttentionMetadata
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.worker.model_runner import ModelInput

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
