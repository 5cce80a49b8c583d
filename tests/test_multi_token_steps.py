"""Steps that give a sequence several tokens (as speculative decoding's accepted proposals will): a stand-in model
runner returns two tokens per sampled sequence, and the scheduler (stop tokens, max_tokens) and the output processor
(stop strings, text) take them in turn. Nothing past a stop or max_tokens is emitted, and the next step computes
the tokens that have no K/V yet as a chunk."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tinyvllm.contract import ModelRunnerOutput
from tinyvllm.engine.block_manager import BlockManager
from tinyvllm.engine.output_processor import OutputProcessor
from tinyvllm.engine.scheduler import Scheduler
from tinyvllm.engine.sequence import Sequence
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import SamplingParams

EOS = 2


def _run(params: SamplingParams, script: list[int], tokenizer=None, per_step: int = 2
         ) -> tuple[RequestOutput, list[list[int]], list[int]]:
    """One request of prompt [5, 6, 7] whose stand-in runner returns the next `per_step` tokens of `script` for it
    at every step that samples it. Returns its final output, the token lists the runner returned, and each step's
    new-token count for the sequence."""
    scheduler = Scheduler(BlockManager(32, 4, enable_prefix_caching=False), 8, 64, 256)
    stop_ids = frozenset({EOS} if not params.ignore_eos else ()) | frozenset(params.stop_token_ids or ())
    seq = Sequence(0, "r", 0, [5, 6, 7], params, seed=0, stop_token_ids=stop_ids, eos_token_ids=frozenset({EOS}))
    scheduler.add(seq)
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [5, 6, 7], params, "cumulative", 0.0)
    tokens: Iterator[int] = iter(script)
    returned: list[list[int]] = []
    step_sizes: list[int] = []
    final = None
    while final is None:
        step = scheduler.schedule()
        assert not step.is_empty(), "the sequence is neither finished nor scheduled"
        step_sizes += step.num_new_tokens
        sampled = [i for i in step.seq_ids if scheduler.seqs[i].num_output_placeholders]
        new = [[next(tokens) for _ in range(per_step)] for _ in sampled]
        returned += new
        core_outputs = scheduler.update_from_output(step, ModelRunnerOutput(sampled, new, [None] * len(new)))
        outputs, stopped = processor.process(core_outputs)
        for _, _, stop in stopped:  # (what the engine core does for a stop string)
            scheduler.finish(scheduler.seqs[0], "stop", stop)
        final = next((o for o in outputs if o.finished), None)
    assert not scheduler.running and not scheduler.waiting
    scheduler.block_manager.check_whole()
    return final, returned, step_sizes


def test_max_tokens_cuts_a_step_of_two():
    output, returned, step_sizes = _run(SamplingParams(max_tokens=5, ignore_eos=True), list(range(100, 120)))
    completion = output.outputs[0]
    assert completion.token_ids == [100, 101, 102, 103, 104] and completion.finish_reason == "length"
    assert returned == [[100, 101], [102, 103], [104, 105]]  # 105 came back past max_tokens: dropped
    assert step_sizes == [3, 2, 2]  # the prompt, then each step the token without K/V and the newest


def test_a_stop_token_first_of_two_drops_the_second():
    output, returned, _ = _run(SamplingParams(max_tokens=20), [100, 101, EOS, 103, 104])
    completion = output.outputs[0]
    assert completion.token_ids == [100, 101, EOS] and completion.finish_reason == "stop"
    assert returned[-1] == [EOS, 103]
    stopped, _, _ = _run(SamplingParams(max_tokens=20, stop_token_ids=[101]), [100, 101, 102])
    assert stopped.outputs[0].token_ids == [100, 101] and stopped.outputs[0].stop_reason == 101


@pytest.fixture(scope="module")
def tokenizer(smol_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_tokenizer_dir)


def test_a_stop_string_inside_a_step_ends_the_text_there(tokenizer):
    script = tokenizer.encode("one two three STOP four five six seven", add_special_tokens=False)
    output, returned, _ = _run(SamplingParams(max_tokens=30, stop=["STOP"]), script, tokenizer)
    completion = output.outputs[0]
    assert completion.text == "one two three " and completion.finish_reason == "stop"
    assert completion.stop_reason == "STOP"
    # the output holds the tokens up to the stop string's, and the runner was not asked for more
    stop_at = next(i for i in range(len(script)) if "STOP" in tokenizer.decode(script[: i + 1]))
    assert completion.token_ids == script[: stop_at + 1]
    assert sum(len(r) for r in returned) <= stop_at + 2


def test_one_token_steps_are_the_special_case(tokenizer):
    script = tokenizer.encode("one two three STOP four", add_special_tokens=False)
    one, _, sizes = _run(SamplingParams(max_tokens=30, stop=["STOP"]), script, tokenizer, per_step=1)
    two, _, _ = _run(SamplingParams(max_tokens=30, stop=["STOP"]), script, tokenizer, per_step=2)
    assert one.outputs[0].text == two.outputs[0].text == "one two three "
    assert sizes[1:] == [1] * (len(sizes) - 1)  # a decode is one token a step
