"""The decode CUDA graphs' inputs (worker/cuda_graphs.py, DecodeInputs), on the CPU: a step's arrays packed in the
buffer's fixed layout, copied in at once, and completed by the graph's first op, give the tensors the graph reads,
with the rows past the batch padded so that they read and write nothing; and the model runner's whole graph path,
with graphs that run their step eagerly, gives the eager path's tokens."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.utils import save_tiny_llama, tiny_llm
from tinyvllm import SamplingParams
from tinyvllm.ops.cascade_attention import CASCADE_MIN_PREFIX_TOKENS, CASCADE_MIN_SEQS
from tinyvllm.worker.cuda_graphs import CudaGraphs, DecodeInputs
from tinyvllm.worker.staging import Staging


def _step(n: int, width: int, sampling: bool, prefix: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(n * 10 + width)
    arrays = dict(input_ids=rng.integers(0, 1000, n), positions=rng.integers(0, 64, n),
                  slot_mapping=rng.integers(0, 512, n), context_lens=rng.integers(1, 64, n).astype(np.int32),
                  block_tables=rng.integers(0, 32, (n, width)).astype(np.int32),
                  logits_indices=np.arange(n), pending=np.where(np.arange(n) % 2 == 1, np.arange(n)[::-1], -1))
    if sampling:
        arrays.update(temperature=rng.random(n).astype(np.float32), top_k=rng.integers(0, 50, n),
                      top_p=rng.random(n).astype(np.float32), min_p=rng.random(n).astype(np.float32),
                      seeds=rng.integers(0, 1 << 62, n))
    if prefix:
        arrays.update(common_prefix_len=np.array([32], dtype=np.int32))
    return arrays


def test_decode_inputs_are_the_steps_arrays_padded_to_the_graph() -> None:
    max_bs, max_blocks, bs = 8, 6, 8
    inputs = DecodeInputs(max_bs, max_blocks, torch.device("cpu"))
    staging = Staging(torch.device("cpu"))
    tokens = torch.arange(100, 100 + max_bs)
    # A bigger step first, so that the buffers hold other values where the next step writes nothing.
    for n, width, sampling, prefix in ((8, 6, True, True), (5, 3, False, False), (3, 2, True, False)):
        arrays = _step(n, width, sampling, prefix)
        inputs.upload(staging, arrays)
        inputs.unpack(bs, tokens)
        f = inputs.fields
        pending = arrays["pending"]
        expected_ids = np.where(pending >= 0, 100 + pending, arrays["input_ids"])
        assert f["input_ids"][:n].tolist() == expected_ids.tolist()
        assert f["positions"][:n].tolist() == arrays["positions"].tolist()
        # padding rows: no K/V stored, no context, no token in flight; tokens and positions in range
        assert f["slot_mapping"][:n].tolist() == arrays["slot_mapping"].tolist()
        assert f["slot_mapping"][n:].tolist() == [-1] * (max_bs - n)  # (every row past the step's: any graph)
        assert f["context_lens"][:n].tolist() == arrays["context_lens"].tolist()
        assert f["context_lens"][n:].tolist() == [0] * (max_bs - n)
        assert f["pending"][n:].tolist() == [-1] * (max_bs - n)
        assert f["input_ids"][n:].tolist() == [0] * (max_bs - n) and f["positions"][n:].tolist() == [0] * (max_bs - n)
        assert inputs.block_tables[:n, :width].tolist() == arrays["block_tables"].tolist()
        if sampling:
            assert torch.equal(f["temperature"][:n], torch.from_numpy(arrays["temperature"]))
            assert f["seeds"][:n].tolist() == arrays["seeds"].tolist()
            assert f["top_k"][:n].tolist() == arrays["top_k"].tolist()
            assert f["temperature"][n:bs].tolist() == [0.0] * (bs - n)  # (padding rows are greedy)
        meta = inputs.metadata(bs, prefix, max_blocks * 16)
        assert meta.is_decode and meta.num_seqs == bs and meta.block_tables.shape == (bs, max_blocks)
        assert meta.cu_query_lens.tolist() == list(range(bs + 1))
        if prefix:
            assert meta.common_prefix_len.tolist() == [32]
        else:
            assert meta.common_prefix_len is None


def test_decode_inputs_copy_only_the_block_table_rows_in_use() -> None:
    inputs = DecodeInputs(16, 64, torch.device("cpu"))
    host = np.zeros(inputs.nbytes, dtype=np.uint8)
    nbytes = inputs.pack(host, _step(4, 3, False, False))
    assert nbytes == inputs.offsets["block_tables"] + 4 * 3 * 4 < inputs.nbytes


# ------------------------------------------------------------------------------ the model runner's graph path


class EagerGraphs(CudaGraphs):
    """CudaGraphs whose graphs run their step when replayed instead of a capture of it: the model runner's decode
    graph path (inputs packed and uploaded, completed by the graph's first op, tokens left for the next step, the
    tails) on the CPU, where nothing can be captured."""

    def _capture(self, step):
        return SimpleNamespace(replay=step)

    def _upload(self) -> None:
        pass


def with_eager_graphs(llm):
    """The LLM's model runner with EagerGraphs (a CPU runner has no CUDA graphs); the replays they ran, by tail."""
    runner = llm.llm_engine.engine_core.model_runner
    config = runner.config
    graphs = EagerGraphs(runner.model, config.max_num_seqs, runner.max_blocks_per_seq, runner.block_size,
                         runner.model_config.hidden_size, runner.dtype, runner.device, config.cascade_attention,
                         tail=runner.draw)
    replays: dict = {}
    replay = graphs.replay

    def counted(bs, shared, mode=None):
        key = (shared and (bs, True, None) in graphs.graphs, mode)
        replays[key] = replays.get(key, 0) + 1
        # (a copy: on the CPU the tokens' "copy to the host" is the tensor itself, and with async scheduling the
        # next replay, which on CUDA comes after that copy in stream order, here overwrites the buffer first)
        return replay(bs, shared, mode).clone()

    graphs.replay = counted
    runner.cuda_graphs = graphs
    return replays


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_llama(str(tmp_path_factory.mktemp("tiny")), seed=5,
                           max_position_embeddings=max(512, 2 * CASCADE_MIN_PREFIX_TOKENS + 128))


def _outputs(llm, prompts, params):
    return [[(c.token_ids, [None if lp is None else sorted(lp) for lp in (c.logprobs or [])]) for c in o.outputs]
            for o in llm.generate(prompts, params, use_tqdm=False)]


def test_graph_path_gives_the_eager_tokens(checkpoint: str) -> None:
    """Greedy, seeded temperature + min-p (the sampling tail), top-k and logprobs (sampled after the graph), with
    more requests than seats and tokens in flight (async scheduling) across graph and eager steps: the same tokens
    through the decode graphs' inputs as through the eager path."""
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 256) for _ in range(rng.randint(3, 40))] for _ in range(10)]
    params = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
              SamplingParams(temperature=0.8, min_p=0.05, seed=7, max_tokens=14, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=20, seed=8, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, logprobs=2, max_tokens=9, ignore_eos=True)]
    workloads = [(prompts, params[0]), (prompts, params[1]), (prompts[:6], params[2]), (prompts[:4], params[3]),
                 (prompts, [params[i % 3] for i in range(len(prompts))])]
    results = []
    for graphs in (False, True):
        llm = tiny_llm(checkpoint, num_kv_blocks=64, max_num_seqs=4, async_scheduling=True)
        replays = with_eager_graphs(llm) if graphs else {}
        results.append([_outputs(llm, p, sp) for p, sp in workloads])
        llm.llm_engine.engine_core.block_manager.check_whole()
    assert results[1] == results[0]
    assert replays.get((False, "greedy")) and replays.get((False, "sample")) and replays.get((False, None))


def test_graph_path_with_cascade_attention(checkpoint: str) -> None:
    """Sequences sharing a cached prefix replay the graphs captured with cascade attention, to the same tokens."""
    rng = random.Random(3)
    system = [rng.randrange(2, 256) for _ in range(CASCADE_MIN_PREFIX_TOKENS + 40)]
    prompts = [system + [rng.randrange(2, 256) for _ in range(rng.randint(1, 20))]
               for _ in range(CASCADE_MIN_SEQS + 2)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    results = []
    for graphs in (False, True):
        llm = tiny_llm(checkpoint, num_kv_blocks=512, max_num_seqs=CASCADE_MIN_SEQS + 8, async_scheduling=True)
        replays = with_eager_graphs(llm) if graphs else {}
        llm.generate(prompts[:1], params, use_tqdm=False)  # the system prompt is cached, as a server's would be
        results.append(_outputs(llm, prompts[1:], params))
    assert results[1] == results[0]
    assert replays.get((True, "greedy"))
