"""The engine end to end on a CUDA GPU, on the Llama-3.2-1B-shaped random-weight model (bench_offline.LLAMA_1B):

1. its logits against transformers' (float32) on the same GPU, with ours in bfloat16 and in float32;
2. greedy generation (4 prompts x 64 tokens) along four paths, each in a fresh process: the Triton kernels with
   CUDA graphs and async scheduling (the default fast path), with CUDA graphs only, eager, and the reference ops
   (the test hook TINYVLLM_REFERENCE_OPS=1, eager). Each run is checked to have taken the path it names. In
   float32 every path gives the same tokens as the eager Triton run (and that one as the reference ops). In
   bfloat16 the paths round differently and random weights give near-ties, so a flip is expected somewhere: identical
   tokens pass, different ones are reported as xfail with the common prefix lengths, not judged;
3. greedy generation of requests sharing a cached prefix with cascade attention on and off (CUDA graphs on):
   the same tokens in float32, and in bfloat16 reported as above;
4. kv_cache_dtype="fp8": float8 caches, the same greedy tokens with CUDA graphs as eager (float32; bfloat16
   reported as above), and about twice the blocks of a bf16 cache at the same gpu_memory_utilization.

    python -m pytest -m cuda tests/gpu/test_engine_cuda.py -ra      (on a GPU machine; skipped elsewhere)
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from tests.utils import CUDA_ONLY, our_logits, random_llama_1b, relative_error, run_python
from tinyvllm.ops.cascade_attention import CASCADE_MIN_PREFIX_TOKENS, CASCADE_MIN_SEQS

pytestmark = CUDA_ONLY

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = [[(i * 37 + j * 11) % 10000 for j in range(n)] for i, n in enumerate((5, 40, 130, 300))]
NUM_TOKENS = 64
# max_num_batched_tokens 256: the longer prompts are chunked, so that steps mix prompt chunks with decodes (the
# piecewise CUDA graphs' case) as well as being prompt-only or decode-only.
ENGINE_ARGS = dict(skip_tokenizer_init=True, max_model_len=2048, gpu_memory_utilization=0.3, max_num_seqs=16,
                   max_num_batched_tokens=256)
LOGIT_LENGTHS = (7, 300, 1500)
LOGIT_TOLERANCE = {"bfloat16": 3e-2, "float32": 1e-4}

# name -> (reference ops, enforce_eager, async_scheduling)
PATHS = {
    "triton+graphs+async": (False, False, True),
    "triton+graphs": (False, False, False),
    "triton eager": (False, True, False),
    "reference ops": (True, True, False),
}
# (path, the path it must agree with)
PAIRS = [("triton eager", "reference ops"), ("triton+graphs", "triton eager"), ("triton+graphs+async", "triton eager")]

# One greedy run in a fresh process (TINYVLLM_REFERENCE_OPS is read when tinyvllm.ops is imported; a process per
# run also gives each engine the whole GPU). Prints RESULT and JSON: the tokens, and what the run took.
GENERATE = r"""
import json, sys
import torch
from tinyvllm import LLM, SamplingParams, ops
path, dtype, enforce_eager, async_scheduling, num_tokens, prompts, engine_args = json.loads(sys.argv[1])
llm = LLM(path, dtype=dtype, enforce_eager=enforce_eager, async_scheduling=async_scheduling, **engine_args)
engine = llm.llm_engine
overlapped, mixed = [], []
engine.add_step_callback(lambda stats: (overlapped.append(stats.num_inputs_in_flight > 0),
                                        mixed.append(stats.num_prefill_tokens > 0 and stats.num_decode_tokens > 0)))
params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
print("RESULT" + json.dumps(dict(
    tokens=tokens, triton=ops.triton_available(),
    decode_kernels=ops.use_decode_kernel("lm_head", torch.empty(1, 1, device="cuda")),
    cuda_graphs=engine.engine_core.model_runner.cuda_graphs is not None,
    piecewise_graphs=engine.engine_core.model_runner.piecewise_graphs is not None,
    steps=len(overlapped), overlapped_steps=sum(overlapped), mixed_steps=sum(mixed))))
"""


@pytest.fixture(scope="module")
def llama_1b() -> str:
    return random_llama_1b()


def free_gpu_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------- logits vs transformers


def logit_ids(n: int) -> list[int]:
    return [(k * 7919) % 10000 for k in range(n)]


@pytest.fixture(scope="module")
def transformers_logits(llama_1b: str) -> dict[int, torch.Tensor]:
    """transformers' float32 logits at every position of each test sequence (kept on the host)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llama_1b, dtype=torch.float32).cuda().eval()
    refs = {}
    with torch.inference_mode():
        for n in LOGIT_LENGTHS:
            refs[n] = hf(torch.tensor([logit_ids(n)], device="cuda")).logits[0].float().cpu()
    del hf
    free_gpu_memory()
    return refs


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_logits_match_transformers(llama_1b: str, transformers_logits: dict[int, torch.Tensor], dtype: str) -> None:
    from tinyvllm import LLM

    tol = LOGIT_TOLERANCE[dtype]
    llm = LLM(llama_1b, dtype=dtype, enforce_eager=True, **ENGINE_ARGS)
    try:
        lines, ok = [], True
        for n in LOGIT_LENGTHS:
            ours = our_logits(llm, logit_ids(n)).float()
            ref = transformers_logits[n].cuda()
            err = relative_error(ours, ref)
            top1 = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
            ok &= err < tol
            lines.append(f"{n} tokens: rel err {err:.2e}{'' if err < tol else ' FAIL'}, top-1 agreement {top1:.1%}")
            del ours, ref
        assert ok, f"logits vs transformers fp32, ours {dtype} (tol {tol}): " + "; ".join(lines)
    finally:
        del llm
        free_gpu_memory()


# ------------------------------------------------------------------------------------------ greedy generation


class GreedyRuns:
    """Each (dtype, path) run once, in its own process, when a test first asks for it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.results: dict[tuple[str, str], dict[str, Any] | str] = {}

    def get(self, dtype: str, name: str) -> dict[str, Any]:
        if (dtype, name) not in self.results:
            self.results[dtype, name] = self._run(dtype, name)
        result = self.results[dtype, name]
        if isinstance(result, str):
            pytest.fail(f"greedy run '{name}' ({dtype}) failed:\n{result}")
        return result

    def _run(self, dtype: str, name: str) -> dict[str, Any] | str:
        reference, eager, overlap = PATHS[name]
        env = {**os.environ, "TINYVLLM_REFERENCE_OPS": "1" if reference else "0"}
        return run_python(GENERATE, [self.path, dtype, eager, overlap, NUM_TOKENS, PROMPTS, ENGINE_ARGS], env, 600)


@pytest.fixture(scope="module")
def greedy_runs(llama_1b: str) -> GreedyRuns:
    free_gpu_memory()  # (the runs size their KV cache from the GPU's free memory)
    return GreedyRuns(llama_1b)


@pytest.mark.parametrize("name", list(PATHS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_run_takes_its_path(greedy_runs: GreedyRuns, dtype: str, name: str) -> None:
    """The run completes, with NUM_TOKENS tokens per prompt, on the path it names: the Triton kernels or the
    reference ops, CUDA graphs captured or not, steps overlapping (async scheduling) or not."""
    reference, eager, overlap = PATHS[name]
    run = greedy_runs.get(dtype, name)
    assert [len(t) for t in run["tokens"]] == [NUM_TOKENS] * len(PROMPTS), \
        f"{name} ({dtype}): tokens per prompt {[len(t) for t in run['tokens']]}, expected {NUM_TOKENS} each"
    assert run["triton"] == (not reference), \
        f"{name} ({dtype}): ops.triton_available() is {run['triton']}, expected {not reference}"
    decode_kernels = not reference
    assert run["decode_kernels"] == decode_kernels, \
        f"{name} ({dtype}): the fused decode kernels {'on' if run['decode_kernels'] else 'off'}, expected " \
        f"{'on' if decode_kernels else 'off'}"
    assert run["cuda_graphs"] == run["piecewise_graphs"] == (not eager), \
        f"{name} ({dtype}): CUDA graphs {'captured' if run['cuda_graphs'] else 'not captured'}, piecewise " \
        f"{'captured' if run['piecewise_graphs'] else 'not captured'}, expected {'none' if eager else 'graphs'}"
    assert run["mixed_steps"] > 0, f"{name} ({dtype}): no step mixed a prompt chunk with decodes"
    if overlap:
        assert run["overlapped_steps"] > 0, \
            f"{name} ({dtype}): async scheduling on, but no step of {run['steps']} took an input still in flight"
    else:
        assert run["overlapped_steps"] == 0, \
            f"{name} ({dtype}): async scheduling off, but {run['overlapped_steps']} of {run['steps']} steps " \
            "took an input still in flight"


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[bool, str]:
    same = [x == y for x, y in zip(a, b)]
    prefix = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x)) for x, y in zip(a, b)]
    return all(same), f"identical {sum(same)}/{len(same)} prompts, common prefix lengths {prefix} of {NUM_TOKENS}"


@pytest.mark.parametrize("pair", [pytest.param(p, id=f"{p[0]} vs {p[1]}") for p in PAIRS])
def test_greedy_float32_same_on_every_path(greedy_runs: GreedyRuns, pair: tuple[str, str]) -> None:
    a, b = pair
    same, detail = agreement(greedy_runs.get("float32", a)["tokens"], greedy_runs.get("float32", b)["tokens"])
    assert same, f"greedy {NUM_TOKENS} tokens in float32: {a} != {b}: {detail}"


@pytest.mark.parametrize("pair", [pytest.param(p, id=f"{p[0]} vs {p[1]}") for p in PAIRS])
def test_greedy_bfloat16_paths_reported(greedy_runs: GreedyRuns, pair: tuple[str, str]) -> None:
    """Reported, not judged: in bf16 the paths round differently and the random weights give near-ties (top-1
    agrees with fp32 on only ~90% of positions), so a flip somewhere is expected. Correctness is judged in
    float32 and on the logits."""
    a, b = pair
    same, detail = agreement(greedy_runs.get("bfloat16", a)["tokens"], greedy_runs.get("bfloat16", b)["tokens"])
    if not same:
        pytest.xfail(f"bf16 greedy {a} vs {b} (a flip at a near-tie is expected): {detail}")


# ------------------------------------------------------------------------------------------ fixed shapes


@contextmanager
def float32_llm(llama_1b: str, **engine_args: Any) -> Iterator[Any]:
    """An in-process float32 engine on the benchmark model, freed afterwards."""
    from tinyvllm import LLM

    llm = LLM(llama_1b, dtype="float32", skip_tokenizer_init=True, gpu_memory_utilization=0.3, max_num_seqs=16,
              **engine_args)
    try:
        yield llm
    finally:
        del llm
        free_gpu_memory()


def generated(llm: Any, prompts: list[list[int]], params: Any) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def test_padded_shapes_change_no_token(llama_1b: str) -> None:
    """float32: a first step of 2,409 prompt tokens through the piecewise graphs (padded up their ladder to 2,560
    tokens), the same step run eagerly padded to a multiple of 256 (as steps past the graphs' 8,192 tokens run, and
    every step with enforce_eager), and the LM head's rows padded up their ladder give the tokens of the same steps
    run eagerly unpadded (prefix caching off, so that every run takes the same steps)."""
    from tinyvllm import SamplingParams

    with float32_llm(llama_1b, max_model_len=4096, max_num_batched_tokens=4096, enable_prefix_caching=False) as llm:
        prompts = [[(i * 31 + j * 7) % 10000 for j in range(n)] for i, n in enumerate((2100, 9, 300))]
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        runner = llm.llm_engine.engine_core.model_runner
        assert runner.fixed_shapes and runner.piecewise_graphs.fits(2409)
        through_graphs = generated(llm, prompts, params)
        runner.piecewise_graphs = None
        padded = generated(llm, prompts, params)
        runner.fixed_shapes = False
        assert through_graphs == padded == generated(llm, prompts, params)


def test_one_sequence_steps_in_whole_graphs(llama_1b: str) -> None:
    """float32: a prompt that comes alone runs its prompt steps as whole CUDA graphs, attention captured in them
    (PiecewiseCudaGraphs.run_whole): a 300-token prompt in a chunk of 256 tokens and one of 44 on those 256 in the
    cache, then a 130-token prompt; their tokens are those of the same steps through the piecewise graphs and run
    eagerly (prefix caching off, so that every run takes the same steps)."""
    from tinyvllm import SamplingParams

    with float32_llm(llama_1b, max_model_len=2048, max_num_batched_tokens=256, enable_prefix_caching=False) as llm:
        runner = llm.llm_engine.engine_core.model_runner
        pieces = runner.piecewise_graphs
        assert pieces.whole and max(pieces.whole) == 256, sorted(pieces.whole)
        calls: list[int] = []
        run_whole = pieces.run_whole
        pieces.run_whole = lambda ids, *rest: (calls.append(ids.shape[0]), run_whole(ids, *rest))[1]
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        prompts = [[(j * 13 + 5) % 10000 for j in range(300)], [(j * 17 + 3) % 10000 for j in range(130)]]
        whole = [generated(llm, [p], params)[0] for p in prompts]
        assert calls == [256, 44, 130], f"steps through the whole graphs: {calls}"
        pieces.whole = {}
        piecewise = [generated(llm, [p], params)[0] for p in prompts]
        runner.piecewise_graphs = None
        eager = [generated(llm, [p], params)[0] for p in prompts]
        assert whole == piecewise == eager


def test_prompt_logprobs_through_graphs_match_transformers(llama_1b: str,
                                                           transformers_logits: dict[int, torch.Tensor]) -> None:
    """float32: prompt logprobs of the logit test's sequences, chunked by 256 tokens, one alone (its first chunk
    through a whole graph) and all three together (piecewise graphs, chunks beside decodes), equal transformers'
    log-softmax; and those of the same steps run eagerly."""
    from tinyvllm import SamplingParams

    prompts = [logit_ids(n) for n in LOGIT_LENGTHS]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    with float32_llm(llama_1b, max_model_len=2048, max_num_batched_tokens=256, enable_prefix_caching=False) as llm:
        alone = llm.generate(prompts[1:2], params, use_tqdm=False)[0].prompt_logprobs
        together = [o.prompt_logprobs for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.llm_engine.engine_core.model_runner.piecewise_graphs = None
        eager = [o.prompt_logprobs for o in llm.generate(prompts, params, use_tqdm=False)]
    for prompt, runs in zip(prompts, zip(together, eager, [None, alone, None])):
        expected = torch.log_softmax(transformers_logits[len(prompt)], dim=-1)
        for got in (run for run in runs if run is not None):
            assert len(got) == len(prompt) and got[0] is None
            errors = [abs(got[i][t].logprob - expected[i - 1, t].item()) for i, t in enumerate(prompt) if i]
            assert max(errors) < 1e-3, (len(prompt), max(errors))


def test_decode_graphs_end_in_the_same_tokens(llama_1b: str) -> None:
    """float32: decode steps through the CUDA graphs that end in tokens (the LM head and the sampler captured)
    draw what the graphs that end in hidden states, with the LM head and the sampler launched after them, draw:
    greedy requests, seeded ones sampling with temperature and min-p (the "sample" tail), top-k ones (no tail:
    the hidden-states graph), and greedy and sampling requests side by side (the "sample" tail)."""
    from tinyvllm import SamplingParams

    with float32_llm(llama_1b, max_model_len=1024) as llm:
        graphs = llm.llm_engine.engine_core.model_runner.cuda_graphs
        assert graphs is not None and graphs.has_tails
        modes: list[str | None] = []
        replay = graphs.replay

        def recording_replay(*args, **kwargs):
            modes.append(args[2] if len(args) > 2 else kwargs.get("mode"))  # replay(bs, shared, mode)
            return replay(*args, **kwargs)

        graphs.replay = recording_replay
        prompts = [[(i * 31 + j * 7) % 10000 for j in range(n)] for i, n in enumerate((9, 40, 130, 300))]
        greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        sample = SamplingParams(temperature=0.8, min_p=0.05, seed=7, max_tokens=24, ignore_eos=True)
        top_k = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=24, ignore_eos=True)
        for mode, params in (("greedy", greedy), ("sample", sample), (None, top_k), ("sample", [greedy, sample] * 2)):
            modes.clear()
            tails = generated(llm, prompts, params)
            assert modes and all(m == mode for m in modes), (mode, modes)
            graphs.has_tails = False  # every decode step through the hidden-states graph
            plain = generated(llm, prompts, params)
            graphs.has_tails = True
            assert tails == plain, mode


# ------------------------------------------------------------------------------ cascade attention, on and off

# Requests sharing a prefix 64 tokens past cascade attention's threshold (cached by a first request, as on a
# server), as many as its threshold and 4 more: their decode steps go through cascade attention when it is on,
# in the CUDA graphs captured with it.
SHARED_PREFIX = [(j * 53) % 10000 for j in range(CASCADE_MIN_PREFIX_TOKENS + 64)]
SHARED_PROMPTS = [SHARED_PREFIX + [(i * 97 + j * 13) % 10000 for j in range(8 + 3 * i)]
                  for i in range(CASCADE_MIN_SEQS + 5)]
SHARED_ENGINE_ARGS = {**ENGINE_ARGS, "max_num_seqs": max(16, len(SHARED_PROMPTS)),
                      "max_model_len": max(2048, len(SHARED_PROMPTS[-1]) + NUM_TOKENS)}

GENERATE_SHARED = r"""
import json, sys
from tinyvllm import LLM, SamplingParams
path, dtype, cascade, num_tokens, prompts, engine_args = json.loads(sys.argv[1])
llm = LLM(path, dtype=dtype, cascade_attention=cascade, **engine_args)
runner = llm.llm_engine.engine_core.model_runner
graphs = runner.cuda_graphs
cascade_steps, replayed = [], []
prepare = runner.prepare
def recording_prepare(step):
    inputs = prepare(step)
    if inputs.plan.graph_size is not None:  # (a graph step: its inputs are in the graphs' buffer)
        if inputs.plan.shared_prefix:
            cascade_steps.append(len(step.seq_ids))
            replayed.append(True)
    elif inputs.meta.common_prefix_len is not None:
        cascade_steps.append(inputs.meta.num_seqs)
        replayed.append(False)
    return inputs
runner.prepare = recording_prepare
params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
llm.generate(prompts[:1], params, use_tqdm=False)
tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts[1:], params, use_tqdm=False)]
print("RESULT" + json.dumps(dict(tokens=tokens, cascade_steps=len(cascade_steps), replayed=sum(replayed),
                                 cascade_graphs=sum(shared for _, shared, _ in graphs.graphs) if graphs else 0)))
"""


@pytest.fixture(scope="module")
def cascade_runs(llama_1b: str) -> dict[tuple[str, bool], dict[str, Any]]:
    free_gpu_memory()
    runs = {}
    for dtype in ("float32", "bfloat16"):
        for cascade in (True, False):
            result = run_python(GENERATE_SHARED, [llama_1b, dtype, cascade, NUM_TOKENS, SHARED_PROMPTS,
                                                  SHARED_ENGINE_ARGS], dict(os.environ), 600)
            if isinstance(result, str):
                pytest.fail(f"shared-prefix greedy run, cascade {'on' if cascade else 'off'} ({dtype}) failed:\n"
                            f"{result}")
            runs[dtype, cascade] = result
    return runs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cascade_attention_greedy_same_on_and_off(cascade_runs: dict, dtype: str) -> None:
    """With cascade attention on, decode steps of the shared-prefix requests take it, through CUDA graphs; off,
    none does. In float32 the tokens must be the same; in bfloat16 a flip at a near-tie is reported (xfail)."""
    on, off = cascade_runs[dtype, True], cascade_runs[dtype, False]
    assert on["cascade_graphs"] > 0 and off["cascade_graphs"] == 0, (on["cascade_graphs"], off["cascade_graphs"])
    assert on["cascade_steps"] > NUM_TOKENS // 2 and on["replayed"] == on["cascade_steps"], \
        f"cascade steps {on['cascade_steps']}, of which replayed as CUDA graphs {on['replayed']}"
    assert off["cascade_steps"] == 0
    same, detail = agreement(on["tokens"], off["tokens"])
    if dtype == "float32":
        assert same, f"greedy {NUM_TOKENS} tokens in float32, cascade attention on != off: {detail}"
    elif not same:
        pytest.xfail(f"bf16 greedy, cascade attention on vs off (a flip at a near-tie is expected): {detail}")


# The SHARED_PROMPTS sent together, nothing cached: with prefix caching on the first computes the shared prefix and
# the others, waiting for it, are seated in the next step, which async scheduling (on by default on CUDA) plans and
# launches before the prefix's step is read back (Scheduler.cache_launched): they read its blocks in stream order.
GENERATE_TOGETHER = r"""
import json, sys
from tinyvllm import LLM, SamplingParams
path, caching, num_tokens, prompts, engine_args = json.loads(sys.argv[1])
llm = LLM(path, dtype="float32", enable_prefix_caching=caching, cascade_attention=False, **engine_args)
params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
print("RESULT" + json.dumps(dict(tokens=tokens, hits=llm.llm_engine.get_stats()["prefix_cache_hits"],
                                 async_scheduling=llm.llm_engine.engine_core.async_scheduling)))
"""


def test_requests_sent_together_read_the_prefix_as_its_step_writes_it(llama_1b: str) -> None:
    """Requests sent together with a prefix nobody has cached: with caching on they take the first's prefix
    blocks from the step after the one computing them, before that step is read back. In float32 the tokens
    equal a run without the prefix cache, where each computes the prefix itself."""
    runs = {}
    for caching in (True, False):
        free_gpu_memory()
        result = run_python(GENERATE_TOGETHER, [llama_1b, caching, NUM_TOKENS, SHARED_PROMPTS, SHARED_ENGINE_ARGS],
                            dict(os.environ), 600)
        if isinstance(result, str):
            pytest.fail(f"shared-prefix run sent together, prefix caching {'on' if caching else 'off'}:\n{result}")
        runs[caching] = result
    assert runs[True]["async_scheduling"] and runs[True]["hits"] > 0 and runs[False]["hits"] == 0
    same, detail = agreement(runs[True]["tokens"], runs[False]["tokens"])
    assert same, f"greedy {NUM_TOKENS} tokens in float32, the prefix taken from the first request or computed: {detail}"


# ------------------------------------------------------------------------------------------ float8 KV cache

# One greedy run with a given kv_cache_dtype, in a fresh process; prints RESULT and JSON: the tokens (and with
# `logprobs`, each token's top-N as {token: logprob}), the cache's dtype and blocks, and whether CUDA graphs were
# captured.
GENERATE_KV = r"""
import json, sys
from tinyvllm import LLM, SamplingParams
path, dtype, kv_cache_dtype, enforce_eager, num_tokens, prompts, engine_args, logprobs = json.loads(sys.argv[1])
llm = LLM(path, dtype=dtype, kv_cache_dtype=kv_cache_dtype, enforce_eager=enforce_eager, **engine_args)
runner = llm.llm_engine.engine_core.model_runner
attn = runner.model.model.layers[0].self_attn.attn
tokens, top = [], []
if num_tokens:
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True, logprobs=logprobs)
    for o in llm.generate(prompts, params, use_tqdm=False):
        tokens.append(list(o.outputs[0].token_ids))
        top.append([{t: p.logprob for t, p in d.items()} for d in o.outputs[0].logprobs or []])
print("RESULT" + json.dumps(dict(tokens=tokens, logprobs=top, cache_dtype=str(attn.k_cache.dtype),
                                 num_blocks=runner.num_blocks, cuda_graphs=runner.cuda_graphs is not None)))
"""
# The pool sized from the GPU's memory, not capped by max_num_seqs x max_model_len (1024 x 2048 tokens: 131,072
# blocks, more than 20% of an H100 holds for this model in either dtype).
CAPACITY_ARGS = dict(skip_tokenizer_init=True, max_model_len=2048, gpu_memory_utilization=0.2, max_num_seqs=1024)


def kv_run(llama_1b: str, dtype: str, kv_cache_dtype: str, eager: bool, num_tokens: int = NUM_TOKENS,
           engine_args: dict | None = None, logprobs: int | None = None) -> dict[str, Any]:
    free_gpu_memory()
    result = run_python(GENERATE_KV, [llama_1b, dtype, kv_cache_dtype, eager, num_tokens, PROMPTS,
                                      engine_args or ENGINE_ARGS, logprobs], dict(os.environ), 600)
    if isinstance(result, str):
        pytest.fail(f"run with kv_cache_dtype={kv_cache_dtype} ({dtype}, {'eager' if eager else 'graphs'}) failed:\n"
                    f"{result}")
    return result


def parted_at_near_ties(a: dict[str, Any], b: dict[str, Any]) -> tuple[bool, str]:
    """vLLM's check_logprobs_close on two greedy runs: each prompt's tokens agree up to the first position where
    they differ, and there each run's token is among the other's top-N (a near-tie); after it the texts may part."""
    ok, parted = True, []
    for tokens_a, tokens_b, top_a, top_b in zip(a["tokens"], b["tokens"], a["logprobs"], b["logprobs"]):
        position = next((i for i, (x, y) in enumerate(zip(tokens_a, tokens_b)) if x != y), None)
        if position is not None:
            x, y = tokens_a[position], tokens_b[position]
            tie = str(x) in top_b[position] and str(y) in top_a[position]
            ok &= tie
            parted.append(f"at {position}: {x} / {y}" + ("" if tie else f", NOT a near-tie: {top_a[position]} / "
                                                           f"{top_b[position]}"))
    return ok, "; ".join(parted) or "every token the same"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_kv_cache_same_tokens_with_cuda_graphs_and_eager(llama_1b: str, dtype: str) -> None:
    """kv_cache_dtype="fp8": the caches are float8 e4m3; CUDA graphs (decode and piecewise, capturing the float8
    caches) give the tokens of eager steps up to a near-tie (parted_at_near_ties, with the top 5), in float32 too.
    A float8 cache makes a last-bit difference an e4m3 step wherever a value sits at a rounding boundary, and the
    graphs' steps do not round as eager's do (padded shapes, other cuBLAS kernels), so exact tokens are not a
    property of the code even in float32 (benchmarks/RESULTS.md, ninth session). A graph that read a wrong cache
    would part at once, and not at a near-tie."""
    graphs = kv_run(llama_1b, dtype, "fp8", eager=False, logprobs=5)
    eager = kv_run(llama_1b, dtype, "fp8", eager=True, logprobs=5)
    for name, run in (("graphs", graphs), ("eager", eager)):
        assert run["cache_dtype"] == "torch.float8_e4m3fn", f"{name}: the cache is {run['cache_dtype']}"
        assert [len(t) for t in run["tokens"]] == [NUM_TOKENS] * len(PROMPTS), name
        assert [len(t) for t in run["logprobs"]] == [NUM_TOKENS] * len(PROMPTS), name
    assert graphs["cuda_graphs"] and not eager["cuda_graphs"]
    ok, detail = parted_at_near_ties(graphs, eager)
    assert ok, f"greedy {NUM_TOKENS} tokens in {dtype} with an fp8 cache, graphs vs eager: {detail}"


def test_fp8_kv_cache_holds_twice_the_blocks(llama_1b: str) -> None:
    """At the same gpu_memory_utilization a float8 cache gets about twice the blocks of a bf16 one (a little more:
    the profiling step's own cache is half as big too)."""
    auto = kv_run(llama_1b, "bfloat16", "auto", eager=True, num_tokens=0, engine_args=CAPACITY_ARGS)
    fp8 = kv_run(llama_1b, "bfloat16", "fp8", eager=True, num_tokens=0, engine_args=CAPACITY_ARGS)
    assert auto["cache_dtype"] == "torch.bfloat16" and fp8["cache_dtype"] == "torch.float8_e4m3fn"
    ratio = fp8["num_blocks"] / auto["num_blocks"]
    assert 1.95 <= ratio <= 2.1, f"blocks: fp8 {fp8['num_blocks']}, bf16 {auto['num_blocks']} (x{ratio:.3f})"
