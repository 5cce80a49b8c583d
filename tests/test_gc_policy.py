"""LLM.generate collects less while it runs (engine/gc_policy.py) and leaves the process's collector as it found
it: the same thresholds, nothing left frozen, and a caller's own freeze untouched."""

import gc

from tests.utils import tiny_llama_fixture, tiny_llm
from tinyvllm import SamplingParams
from tinyvllm.engine import gc_policy

checkpoint = tiny_llama_fixture(seed=6)


def test_generate_leaves_the_collector_as_it_found_it(checkpoint):
    llm = tiny_llm(checkpoint, num_kv_blocks=16)
    seen = []
    llm.llm_engine.add_step_callback(lambda stats: seen.append((gc.get_threshold()[0], gc.get_freeze_count())))
    threshold = gc.get_threshold()
    assert gc.get_freeze_count() == 0
    llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert seen and all(t == max(threshold[0], gc_policy.YOUNG_THRESHOLD) and frozen > 0 for t, frozen in seen)
    assert gc.get_threshold() == threshold and gc.get_freeze_count() == 0


def test_a_callers_freeze_is_left_alone():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with gc_policy.serving():
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
