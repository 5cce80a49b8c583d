"""How big the KV pool is: kv_cache_memory when given (on the CPU and the GPU alike), else on the CPU what the
model and max_num_seqs need within a tenth of the available memory (tests/test_gguf_int4.py holds the rule), and
never more than max_num_seqs sequences of max_model_len tokens can use."""

import pytest

from tests.utils import tiny_llama_fixture, tiny_llm
from tinyvllm.config import ConfigError
from tinyvllm.worker.kv_cache import _available_memory, kv_cache_bytes_per_block

checkpoint = tiny_llama_fixture(seed=3)


def pool(llm):
    core = llm.llm_engine.engine_core
    runner = core.model_runner
    return core.block_manager.num_blocks, kv_cache_bytes_per_block(runner.model, 16, runner.kv_cache_dtype)


def test_kv_cache_memory_sets_the_pool(checkpoint):
    num_blocks, bytes_per_block = pool(tiny_llm(checkpoint, kv_cache_memory="1MiB"))
    assert num_blocks == 2**20 // bytes_per_block


def test_the_default_pool_fits_what_the_limits_can_use(checkpoint):
    llm = tiny_llm(checkpoint, max_num_seqs=4, max_model_len=256)
    num_blocks, bytes_per_block = pool(llm)
    assert num_blocks == 4 * 256 // 16  # the tiny model's whole need is far below a tenth of the memory
    available = _available_memory()  # (before the pool takes its share; other processes move it a little)
    num_blocks, bytes_per_block = pool(tiny_llm(checkpoint, max_num_seqs=2**20))
    assert 0.8 * available // 10 <= num_blocks * bytes_per_block <= 1.25 * available // 10


@pytest.mark.parametrize("value", ["lots", "0", "-5GiB", "3 parsecs"])
def test_a_size_it_cannot_read_is_refused(checkpoint, value):
    with pytest.raises(ConfigError, match="kv_cache_memory must be a positive size"):
        tiny_llm(checkpoint, kv_cache_memory=value)
