"""Tensor parallelism on the CPU: two gloo ranks, each holding its shard of a small Llama, give the logits of
the unsplit model through a ragged prefill and a decode step on the paged KV cache."""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from tests.utils import save_tiny_llama
from tinyvllm.config import ConfigError, ModelConfig, check_tensor_parallel_size
from tinyvllm.distributed import TensorParallel, destroy_tensor_parallel, init_tensor_parallel
from tinyvllm.model.loader import build_model
from tinyvllm.ops import AttentionMetadata

CONFIGS = {
    # 251 = 2 * 126 - 1: rank 1's last embedding row is padding, and the tied LM head shares it.
    "gqa-tied-odd-vocab": dict(vocab_size=251, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                               tie_word_embeddings=True),
    "mha-untied-biases": dict(vocab_size=256, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
                              tie_word_embeddings=False, attention_bias=True, mlp_bias=True),
}
SIZE = 2
BLOCK_SIZE, NUM_BLOCKS = 4, 8
PROMPT_LENS = [5, 1, 19]
BLOCK_TABLES = [[3, 7], [0], [1, 2, 4, 5, 6]]  # scattered blocks; room for one decode token each
CHILD_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    from safetensors.torch import load_file, save_file

    paths = {}
    for i, (name, overrides) in enumerate(CONFIGS.items()):
        path = save_tiny_llama(str(tmp_path_factory.mktemp(name)), seed=i, **overrides)
        file = os.path.join(path, "model.safetensors")
        tensors = load_file(file)
        generator = torch.Generator().manual_seed(i)
        for key, tensor in tensors.items():
            if key.endswith(".bias"):  # transformers initializes biases to zero, which would test nothing
                tensors[key] = 0.1 * torch.randn(tensor.shape, generator=generator)
        save_file(tensors, file, metadata={"format": "pt"})
        paths[name] = path
    return paths


def build(path: str, tp: TensorParallel) -> torch.nn.Module:
    return build_model(ModelConfig.from_hf_dir(path), path, torch.device("cpu"), torch.float32, 64, tp)


def paged_step(query_lens: list[int], context_lens: list[int]) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions and metadata of a step adding query_lens[i] tokens to sequence i (BLOCK_TABLES[i])."""
    positions, slots = [], []
    for table, query_len, context_len in zip(BLOCK_TABLES, query_lens, context_lens):
        for p in range(context_len - query_len, context_len):
            positions.append(p)
            slots.append(table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
    width = max(map(len, BLOCK_TABLES))
    meta = AttentionMetadata(
        cu_query_lens=torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in BLOCK_TABLES], dtype=torch.int32),
        slot_mapping=torch.tensor(slots), max_query_len=max(query_lens), max_context_len=max(context_lens))
    return torch.tensor(positions), meta


@torch.inference_mode()
def prefill_then_decode(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """Logits of every prompt token of a ragged prefill, then of one decode token per sequence."""
    vocab = model.config.vocab_size
    for layer in model.model.layers:
        attn = layer.self_attn.attn
        shape = (NUM_BLOCKS, BLOCK_SIZE, attn.num_kv_heads, attn.head_dim)  # this rank's KV heads
        attn.k_cache, attn.v_cache = torch.zeros(shape), torch.zeros(shape)
    prompt_ids = torch.randint(vocab, (sum(PROMPT_LENS),), generator=torch.Generator().manual_seed(0))
    prompt_ids[-1] = vocab - 1  # the last id, in the last rank's range next to the padding
    positions, meta = paged_step(PROMPT_LENS, PROMPT_LENS)
    prefill = model.compute_logits(model(prompt_ids, positions, meta))
    positions, meta = paged_step([1] * len(PROMPT_LENS), [n + 1 for n in PROMPT_LENS])
    decode = model.compute_logits(model(torch.tensor([vocab - 1, 0, vocab // 2]), positions, meta))
    return {"prefill": prefill, "decode": decode}


def _rank_main(rank: int, init_method: str, paths: dict[str, str], out_dir: str) -> None:
    """One rank: its shard of every checkpoint through prefill_then_decode; rank 0 saves the logits."""
    try:
        torch.set_num_threads(1)
        tp = init_tensor_parallel(rank, SIZE, init_method, torch.device("cpu"), timeout_s=CHILD_TIMEOUT_S)
        results = {name: prefill_then_decode(build(path, tp)) for name, path in paths.items()}
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "rank0.pt"))
        elif any(logits is not None for steps in results.values() for logits in steps.values()):
            raise AssertionError("only rank 0 should get logits")
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.error"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        destroy_tensor_parallel()


def test_two_ranks_give_the_unsplit_logits(checkpoints, tmp_path):
    context = mp.get_context("spawn")
    init_method = f"file://{tmp_path}/rendezvous"
    procs = [context.Process(target=_rank_main, args=(rank, init_method, checkpoints, str(tmp_path)))
             for rank in range(SIZE)]
    for p in procs:
        p.start()
    expected = {name: prefill_then_decode(build(path, TensorParallel())) for name, path in checkpoints.items()}
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    # A rank that fails leaves the other waiting in a collective: stop both as soon as one fails.
    while any(p.is_alive() for p in procs) and not any(p.exitcode for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    exitcodes = [p.exitcode for p in procs]  # None: still running
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errors = "".join(open(tmp_path / f"rank{r}.error").read() for r in range(SIZE)
                     if (tmp_path / f"rank{r}.error").exists())
    assert not any(exitcodes), f"rank exit codes {exitcodes}\n{errors}"
    assert None not in exitcodes, f"ranks still running after {CHILD_TIMEOUT_S} s"
    results = torch.load(tmp_path / "rank0.pt")
    for name in checkpoints:
        for step in ("prefill", "decode"):
            got, want = results[name][step], expected[name][step]
            assert got.shape == want.shape == (want.shape[0], CONFIGS[name]["vocab_size"])
            where = f"{name} {step}"
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m, where=where: f"{where}: {m}")


def expected_shard(name: str, full: dict[str, torch.Tensor], config: ModelConfig, rank: int) -> torch.Tensor:
    """The slice of the checkpoint that rank `rank` of SIZE should hold in parameter `name`, built by hand."""
    def rows(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        n = t.shape[dim] // SIZE
        return t.narrow(dim, rank * n, n)

    prefix, _, kind = name.rpartition(".")  # kind: weight or bias
    if prefix.endswith("qkv_proj"):
        return torch.cat([rows(full[prefix.replace("qkv_proj", p) + "." + kind]) for p in ("q_proj", "k_proj",
                                                                                          "v_proj")])
    if prefix.endswith("gate_up_proj"):
        return torch.cat([rows(full[prefix.replace("gate_up_proj", p) + "." + kind]) for p in ("gate_proj",
                                                                                              "up_proj")])
    if prefix.endswith(("o_proj", "down_proj")):
        return rows(full[name], dim=1) if kind == "weight" else full[name]  # the bias: whole, added by rank 0
    if prefix in ("model.embed_tokens", "lm_head"):
        n = -(-config.vocab_size // SIZE)
        padded = torch.cat([full[name], torch.zeros(n * SIZE - config.vocab_size, config.hidden_size)])
        return padded[rank * n:(rank + 1) * n]
    return full[name]  # the norms: every rank holds them whole


@pytest.mark.parametrize("rank", range(SIZE))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_rank_reads_only_its_shard(checkpoints, name, rank, monkeypatch):
    import safetensors
    from safetensors.torch import load_file

    real_safe_open, elements_read = safetensors.safe_open, []

    class RecordingFile:
        def __init__(self, file: str, framework: str) -> None:
            self.file = real_safe_open(file, framework=framework)

        def __enter__(self) -> RecordingFile:
            self.file.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self.file.__exit__(*exc)

        def keys(self) -> list[str]:
            return self.file.keys()

        def get_tensor(self, key: str) -> torch.Tensor:
            raise AssertionError(f"a rank read the whole of {key}")

        def get_slice(self, key: str) -> object:
            lazy = self.file.get_slice(key)

            class RecordingSlice:
                def get_shape(self) -> list[int]:
                    return lazy.get_shape()

                def __getitem__(self, index: object) -> torch.Tensor:
                    tensor = lazy[index]
                    elements_read.append(tensor.numel())
                    return tensor

            return RecordingSlice()

    monkeypatch.setattr(safetensors, "safe_open", RecordingFile)
    path = checkpoints[name]
    model = build(path, TensorParallel(rank, SIZE))  # loading needs no process group
    config = model.config
    full = load_file(os.path.join(path, "model.safetensors"))
    held = 0
    for param_name, param in model.named_parameters():
        torch.testing.assert_close(param.data, expected_shard(param_name, full, config, rank), rtol=0, atol=0)
        held += param.numel()
    attn = model.model.layers[0].self_attn.attn
    assert (attn.num_heads, attn.num_kv_heads) == (config.num_heads // SIZE, config.num_kv_heads // SIZE)
    vocab_rows = -(-config.vocab_size // SIZE)
    padding_rows = max(0, (rank + 1) * vocab_rows - config.vocab_size)
    vocab_tables = 1 if config.tie_word_embeddings else 2
    assert sum(elements_read) == held - padding_rows * config.hidden_size * vocab_tables


def test_tensor_parallel_sizes_are_checked(checkpoints):
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=251, hidden_size=96, intermediate_size=96,
                         num_layers=1, num_heads=6, num_kv_heads=2, head_dim=16)
    for size in (1, 2):
        check_tensor_parallel_size(config, size)
    with pytest.raises(ConfigError, match="num_attention_heads=6"):
        check_tensor_parallel_size(config, 4)
    with pytest.raises(ConfigError, match="num_key_value_heads=2"):
        check_tensor_parallel_size(config, 3)
    with pytest.raises(ConfigError, match="intermediate_size=90"):
        check_tensor_parallel_size(dataclasses.replace(config, num_heads=4, num_kv_heads=4, intermediate_size=90), 4)
    for size in (0, -1):
        with pytest.raises(ConfigError, match="positive"):
            check_tensor_parallel_size(config, size)
    check_tensor_parallel_size(config, 2, "cuda", num_gpus=2)
    check_tensor_parallel_size(config, 2, "cpu", num_gpus=0)
    with pytest.raises(ConfigError, match="needs 2 GPUs, but 1 are visible"):
        check_tensor_parallel_size(config, 2, "cuda", num_gpus=1)
    with pytest.raises(ConfigError, match="num_attention_heads=4"):
        build(checkpoints["gqa-tied-odd-vocab"], TensorParallel(0, 3))


# ---- the engine: LLM(tensor_parallel_size=N), ranks 1..N-1 in worker processes ----------------------------


def engine_outputs(path: str, prompts, params, **kwargs):
    from tinyvllm import LLM

    llm = LLM(path, device="cpu", **kwargs)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        llm.llm_engine.engine_core.block_manager.check_whole()
        return [o.outputs[0].token_ids for o in outputs]
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_engine_greedy_outputs_equal_one_rank(checkpoints, name, async_scheduling):
    from tinyvllm import SamplingParams

    prompts = [[(7 * i + j) % 200 + 2 for j in range(3 + 11 * i)] for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kwargs = dict(skip_tokenizer_init=True, num_kv_blocks=32, block_size=16, max_num_batched_tokens=24,
                  async_scheduling=async_scheduling)  # chunked prefill, mixed with decodes
    one = engine_outputs(checkpoints[name], prompts, params, **kwargs)
    two = engine_outputs(checkpoints[name], prompts, params, tensor_parallel_size=2, **kwargs)
    assert two == one


def test_prompt_logprobs_with_two_ranks(checkpoints):
    """Each rank computes its share of the prompt rows' logits, chunk by chunk beside rank 0's: the prompt logprobs
    (chunked prefill, mixed with decodes) are one rank's."""
    from tinyvllm import LLM, SamplingParams

    prompts = [[(5 * i + 3 * j) % 240 + 2 for j in range(9 + 13 * i)] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    results = []
    for size in (1, 2):
        llm = LLM(checkpoints["gqa-tied-odd-vocab"], device="cpu", skip_tokenizer_init=True, num_kv_blocks=32,
                  block_size=16, max_num_batched_tokens=24, tensor_parallel_size=size)
        try:
            results.append([o.prompt_logprobs for o in llm.generate(prompts, params, use_tqdm=False)])
        finally:
            llm.llm_engine.shutdown()
    for one, two in zip(*results):
        assert len(one) == len(two) and one[0] is None and two[0] is None
        for a, b in zip(one[1:], two[1:]):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-5 and a[t].rank == b[t].rank for t in a)


def test_fp8_kv_cache_with_two_ranks(checkpoints):
    """kv_cache_dtype="fp8": each rank allocates its own float8 cache (of its KV heads); outputs as one rank's."""
    from tinyvllm import SamplingParams

    name = next(iter(CONFIGS))
    prompts = [[(7 * i + j) % 200 + 2 for j in range(3 + 11 * i)] for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kwargs = dict(skip_tokenizer_init=True, num_kv_blocks=32, block_size=16, max_num_batched_tokens=24,
                  kv_cache_dtype="fp8")
    one = engine_outputs(checkpoints[name], prompts, params, **kwargs)
    two = engine_outputs(checkpoints[name], prompts, params, tensor_parallel_size=2, **kwargs)
    assert two == one


def test_embedded_model_with_three_ranks():
    """SmolLM2-135M has 9 query and 3 KV heads: 3 ranks split it, 2 cannot (and say so)."""
    from tinyvllm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=16)
    prompts = ["The capital of France is", "Water boils at"]
    one = engine_outputs(None, prompts, params, num_kv_blocks=64)
    three = engine_outputs(None, prompts, params, num_kv_blocks=64, tensor_parallel_size=3)
    assert three == one
    with pytest.raises(ConfigError, match="does not divide the model's num_attention_heads=9"):
        LLM(device="cpu", tensor_parallel_size=2)


def test_a_second_engine_while_one_runs_is_refused(checkpoints):
    from tinyvllm import LLM

    path = checkpoints["gqa-tied-odd-vocab"]
    llm = LLM(path, skip_tokenizer_init=True, device="cpu", num_kv_blocks=32, tensor_parallel_size=2)
    try:
        with pytest.raises(ConfigError, match="already running in this process"):
            LLM(path, skip_tokenizer_init=True, device="cpu", num_kv_blocks=32, tensor_parallel_size=2)
    finally:
        llm.llm_engine.shutdown()


def test_a_dead_worker_fails_the_engine_loudly(checkpoints):
    import signal

    from tinyvllm import LLM, SamplingParams

    llm = LLM(checkpoints["gqa-tied-odd-vocab"], skip_tokenizer_init=True, device="cpu", num_kv_blocks=32,
              tensor_parallel_size=2)
    try:
        worker = llm.llm_engine.engine_core.workers.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"worker rank 1 \(exit code -9\) died"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)
        assert time.monotonic() - start < 10
    finally:
        llm.llm_engine.shutdown()
