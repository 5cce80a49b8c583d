"""The ModelRunner owns the model and its KV cache. Each step it takes a SchedulerOutput (plain data),
updates its own state of the sequences it holds (input_batch.py), builds the batch's tensors and the step's plan
(the path of its forward pass: a CUDA graph for decode steps and for one sequence's prompt steps, graphs of the
pieces between attention calls for other steps of up to 8,192 tokens, when it can, else eager), runs the forward
pass (execute_model), and samples the next token of every sequence whose last known token was in the step
(sample_tokens). It imports nothing from the engine.

A sequence with proposed tokens (speculative decoding: SchedulerOutput.scheduled_spec_decode_tokens) computes its
newest token and the proposals as one chunk, and is sampled at each of those positions; the rejection sampler keeps
the accepted run (rejection_sampler.py). Such steps take more tokens than sequences, so they never replay a decode
graph: on CUDA they run as the whole-step or piecewise graphs, or eager; the engine launches no step ahead of one (the
next step's positions need its accepted count)."""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from tinyvllm import ops
from tinyvllm.config import Config
from tinyvllm.contract import GrammarOutput, SchedulerOutput, SequenceError
from tinyvllm.distributed import TensorParallel
from tinyvllm.model.interface import CausalLM
from tinyvllm.ops import AttentionMetadata
from tinyvllm.ops.cascade_attention import common_prefix_len, use_cascade_attention
from tinyvllm.worker.cuda_graphs import CudaGraphs, PiecewiseCudaGraphs, size_ladder
from tinyvllm.worker.input_batch import LOGPROBS, MIN_TOKENS, PENALTIES, STRUCTURED, InputBatch
from tinyvllm.worker.kv_cache import allocate_kv_cache, decide_num_blocks
from tinyvllm.worker.prompt_logprobs import PromptScoring, find_prompt_scoring, score, to_host
from tinyvllm.worker.rejection_sampler import Verification
from tinyvllm.worker.sampler import AsyncModelRunnerOutput, Sampler, SamplingTensors, step_seeds
from tinyvllm.worker.staging import Staging, broadcast_step, broadcast_stop, receive_step, views

logger = logging.getLogger(__name__)

# cuBLAS chooses a kernel per matrix shape, and the first use of a shape costs a heuristic query on the host and
# may load a kernel module, which waits for the whole device: mid-step, that stalls the host behind the step
# before (async scheduling). So on CUDA the runner keeps its products to a fixed set of shapes, met at start-up:
# the LM head's rows are padded up the decode graphs' ladder of batch sizes (size_ladder), and steps too large
# for the piecewise CUDA graphs (which fix their shapes themselves) to a multiple of EAGER_TOKEN_MULTIPLE tokens
# (of a sixteenth of the size's power of two above WARM_UP_MAX_TOKENS, whose sizes are not run at start-up: each
# would be a whole forward pass). Padding tokens store no K/V (slot -1) and belong to no sequence; every op but
# attention works row by row, so they never touch the real rows.
EAGER_TOKEN_MULTIPLE = 256
EAGER_PADDING_ABOVE = 2048  # smaller steps run through the piecewise graphs, or as they are (eager mode)
WARM_UP_MAX_TOKENS = 8192
# A test hook (docs/architecture.md): the runner refuses any new sequence whose tokens hold this token id, as it
# would one whose state it could not take in, so that tests can see one request fail and the others go on.
FAIL_TOKEN_VARIABLE = "TINYVLLM_TEST_FAIL_TOKEN"


def _offsets_within(counts: np.ndarray) -> np.ndarray:
    """0 .. counts[i] - 1 for each i, concatenated (the place of each row in its group of np.repeat(x, counts))."""
    firsts = np.cumsum(counts) - counts
    return np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(firsts, counts)


def padded_num_tokens(num_tokens: int, max_num_batched_tokens: int) -> int:
    """The token count a step is run at outside the CUDA graphs (see EAGER_TOKEN_MULTIPLE)."""
    if num_tokens <= EAGER_PADDING_ABOVE:
        return num_tokens
    multiple = EAGER_TOKEN_MULTIPLE
    if num_tokens > WARM_UP_MAX_TOKENS:
        multiple = max(multiple, (1 << (num_tokens - 1).bit_length()) // 16)
    rounded = -(-num_tokens // multiple) * multiple
    return max(num_tokens, min(rounded, max_num_batched_tokens))


class Path(enum.Enum):
    """How a step's forward pass runs: the first of these that takes the step's shape (ModelRunner.plan)."""

    DECODE_GRAPH = "decode graph"  # one token per sequence: a captured decode step, which may draw the tokens too
    WHOLE_GRAPH = "whole graph"  # one sequence's prompt tokens: one graph of the whole forward pass
    PIECEWISE = "piecewise graphs"  # graphs of the pieces between attention calls, attention run between them
    EAGER = "eager"  # the model as it is (the CPU, tensor parallelism, --enforce-eager, steps past the graphs)


@dataclass(frozen=True)
class StepPlan:
    """How one step runs: decided once, from its shape, by prepare; carried out by execute_model."""

    path: Path
    num_tokens: int  # the tokens of the forward pass, padding included (EAGER on CUDA: padded_num_tokens)
    graph_size: int | None = None  # DECODE_GRAPH: the batch size of the graph it replays
    tail: str | None = None  # DECODE_GRAPH: the sampling tail the graph ends in (CudaGraphs.tail_mode), or None
    shared_prefix: bool = False  # DECODE_GRAPH: its inputs hold a common prefix length (cascade attention)


@dataclass
class StepTokens:
    """Where a step's tokens go, on the host: per sequence (decodes first) its input batch row, its new tokens,
    the position of the first and the end; per token its position and KV cache slot."""

    seq_ids: list[int]
    rows: np.ndarray
    num_new: np.ndarray
    num_decodes: int  # (AttentionMetadata.num_decodes: 0 for a step of decodes alone)
    starts: np.ndarray
    ends: np.ndarray
    cu_query_lens: np.ndarray  # (num_seqs + 1)
    positions: np.ndarray
    slots: np.ndarray
    block_tables: np.ndarray  # the rows' tables, as wide as the longest needs
    # Per sequence, how many of its new tokens are proposals (the last ones), and the proposals; None: a step
    # without any (the common case)
    num_drafts: np.ndarray | None = None
    drafts: list[list[int]] | None = None

    @property
    def real_ends(self) -> np.ndarray:
        """Per sequence, the end of its new tokens that are its own (not proposals)."""
        return self.ends if self.num_drafts is None else self.ends - self.num_drafts

    @property
    def total(self) -> int:
        return int(self.cu_query_lens[-1])


@dataclass
class ModelInput:
    """A step's plan and its tensors on the device. A decode step that replays a CUDA graph has its inputs in the
    graph's own buffer (DecodeInputs), so only what comes after the graph is here."""

    plan: StepPlan
    input_ids: torch.Tensor | None  # (None: a graph step)
    positions: torch.Tensor | None
    meta: AttentionMetadata | None
    logits_indices: torch.Tensor  # rows of the hidden states whose next token is sampled
    # The input batch's rows of the sequences that sample, in that order; logits_indices may hold more (padding
    # rows, on CUDA, whose results are dropped).
    sampled_rows: np.ndarray
    sampled_seq_ids: list[int]
    sampling: SamplingTensors
    # The prompt tokens the step scores (prompt logprobs), and its rows and targets on the device
    scoring: PromptScoring | None = None
    scoring_tensors: tuple[torch.Tensor, torch.Tensor] | None = None
    # A step that verifies proposals: its sampled hidden rows are 1 + k per sequence (k proposals), which sample at
    # the input batch rows logits_rows
    verification: Verification | None = None
    logits_rows: np.ndarray | None = None


@dataclass
class _Executed:
    """A step between execute_model and sample_tokens: its inputs, and the hidden states of its forward pass, or
    the tokens a decode graph's tail drew."""

    inputs: ModelInput
    hidden: torch.Tensor | None
    tokens: torch.Tensor | None
    timer: tuple[torch.cuda.Event, torch.cuda.Event] | None


class ModelRunner:
    def __init__(self, model: CausalLM, resolved: Config, tp: TensorParallel = TensorParallel(),
                 extra_kv_bytes_per_block: int = 0) -> None:
        """extra_kv_bytes_per_block: of another KV cache given as many blocks as this one (a draft model's), for the
        pool's sizing from the memory left."""
        self.model = model
        self.tp = tp
        self.model_config = model_config = resolved.model
        self.config = config = resolved.engine
        self.device = device = resolved.device
        self.dtype = dtype = resolved.dtype
        self.block_size = config.block_size
        self.max_blocks_per_seq = (resolved.max_model_len + self.block_size - 1) // self.block_size
        self.sampler = Sampler(model_config.vocab_size, device)
        # The model's dtype, or float8 e4m3 (kv_cache_dtype="fp8": half the bytes per block, twice the blocks)
        self.kv_cache_dtype = config.resolve_kv_cache_dtype(dtype)
        self.num_blocks = decide_num_blocks(model, config, device, self.kv_cache_dtype, self.max_blocks_per_seq, tp,
                                            extra_kv_bytes_per_block)
        allocate_kv_cache(model, self.num_blocks, self.block_size, self.kv_cache_dtype, device)
        self.input_batch = InputBatch(2 * config.max_num_seqs, self.max_blocks_per_seq)
        fail_token = os.environ.get(FAIL_TOKEN_VARIABLE)
        self.fail_token = int(fail_token) if fail_token else None
        self._staging = Staging(device)
        self._last_output: AsyncModelRunnerOutput | None = None  # the step before: its tokens may be in flight
        self._executed: _Executed | None = None  # the step execute_model launched, until sample_tokens
        self.cuda_graphs: CudaGraphs | None = None
        self.piecewise_graphs: PiecewiseCudaGraphs | None = None
        # (The reference ops synchronize with the host, so they are not capturable; and graphs holding NCCL
        # collectives are not captured yet: tensor parallelism runs eager.)
        if device.type == "cuda" and not config.enforce_eager and ops.triton_available() and tp.size == 1:
            reserved = torch.cuda.memory_reserved(device)
            self.cuda_graphs = CudaGraphs(model, config.max_num_seqs, self.max_blocks_per_seq, self.block_size,
                                          model_config.hidden_size, dtype, device, config.cascade_attention,
                                          tail=self.draw)
            self.piecewise_graphs = PiecewiseCudaGraphs(model, config.max_num_batched_tokens, device,
                                                        self.cuda_graphs.pool, self.max_blocks_per_seq,
                                                        self.block_size, self.cuda_graphs.stream)
            # (not counted in the KV cache's sizing: gpu_memory_utilization's rest must hold it)
            logger.info("CUDA graphs captured: %.2f GiB", (torch.cuda.memory_reserved(device) - reserved) / 2**30)
        self.fixed_shapes = device.type == "cuda"  # (on the CPU shapes cost nothing: the batch runs as it is)
        # (a step samples at most a row per sequence and proposal)
        num_drafts = resolved.speculative.num_speculative_tokens if resolved.speculative else 0
        self.logits_rows = size_ladder(config.max_num_seqs * (1 + num_drafts))
        if self.fixed_shapes and tp.size == 1:  # (with several ranks a warm-up would need them all)
            self.warm_up_shapes()

    @torch.inference_mode()
    def warm_up_shapes(self) -> None:
        """Run the shapes the padding produces once, so that they are not new mid-run: the gather of the rows to
        sample and the LM head at each row count, and a forward pass (attention left out: it has no cuBLAS product)
        at each padded size up to WARM_UP_MAX_TOKENS. CUDA loads a kernel at its first launch (lazy loading), and the
        gather's first launch, inside a big prompt step, was the slowest (benchmarks/RESULTS.md)."""
        hidden_size = self.model_config.hidden_size
        for rows in self.logits_rows:
            hidden = torch.zeros(rows, hidden_size, dtype=self.dtype, device=self.device)
            hidden = hidden[torch.zeros(rows, dtype=torch.int64, device=self.device)]  # (as execute's logits_indices)
            self.model.compute_logits(hidden)
            self.model.greedy_tokens(hidden)  # (the fused LM head, where it applies: compiled now, not mid-run)
        empty = torch.zeros(1, dtype=torch.int32, device=self.device)
        top = min(self.config.max_num_batched_tokens, WARM_UP_MAX_TOKENS)
        plans = (self.plan(2, n) for n in range(EAGER_PADDING_ABOVE + 1, top + 1))  # (of several sequences)
        sizes = sorted({plan.num_tokens for plan in plans if plan.path is Path.EAGER})
        for n in sizes:
            tokens = torch.zeros(n, dtype=torch.int64, device=self.device)
            meta = AttentionMetadata(empty, empty, empty.view(1, 1), torch.full_like(tokens, -1), 1, 1,
                                     attention=lambda q, *_, **__: torch.zeros_like(q))
            self.model(tokens, tokens, meta)
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    # ---- one step ---------------------------------------------------------------------------------
    def plan(self, num_seqs: int, num_tokens: int, tail_sampling: SamplingTensors | None = None,
             shared_prefix: bool = False, scores_prompt: bool = False) -> StepPlan:
        """The path of a step of these sequences and tokens. tail_sampling: the step's sampling hints, when every
        sequence samples (a decode graph may then draw the tokens itself); shared_prefix: the step's sequences
        share a prefix that cascade attention reads once; scores_prompt: it scores prompt tokens (whose rows a
        decode graph's input buffer has no place for)."""
        graphs, pieces = self.cuda_graphs, self.piecewise_graphs
        if graphs is not None and num_tokens == num_seqs and graphs.fits(num_seqs) and not scores_prompt:
            tail = graphs.tail_mode(tail_sampling) if tail_sampling is not None else None
            return StepPlan(Path.DECODE_GRAPH, num_tokens, graphs.batch_size(num_seqs), tail, shared_prefix)
        if pieces is not None and pieces.fits_whole(num_seqs, num_tokens):
            return StepPlan(Path.WHOLE_GRAPH, num_tokens)
        if pieces is not None and pieces.fits(num_tokens):
            return StepPlan(Path.PIECEWISE, num_tokens)
        if self.fixed_shapes and num_tokens > num_seqs:
            num_tokens = padded_num_tokens(num_tokens, self.config.max_num_batched_tokens)
        return StepPlan(Path.EAGER, num_tokens)

    def _update_states(self, step: SchedulerOutput) -> None:
        """Take the step's changes to the sequences held. A new sequence that cannot be taken in is a SequenceError:
        its request fails, and the engine core undoes the step (contract.SequenceError)."""
        batch = self.input_batch
        for seq_id in step.finished_seq_ids:
            batch.remove(seq_id)
        for new in step.new_seqs:
            try:
                if self.fail_token is not None and self.fail_token in new.token_ids:
                    raise RuntimeError(f"{FAIL_TOKEN_VARIABLE} is {self.fail_token}: the test hook refuses it")
                batch.add(new)
            except Exception as e:
                raise SequenceError(new.seq_id, f"{type(e).__name__}: {e}") from e
        for seq_id, num_kept in step.truncated_block_tables.items():
            batch.num_blocks[batch.row_of[seq_id]] = num_kept
        for seq_id, block_ids in step.new_block_ids.items():
            batch.append_blocks(batch.row_of[seq_id], block_ids)

    def prepare(self, step: SchedulerOutput) -> ModelInput:
        """The step's plan and tensors: the sequences' changes taken in, their tokens laid out, the rows that
        sample and their parameters, the path chosen, and everything uploaded in one copy."""
        self._update_states(step)
        tokens = self._lay_out(step)
        batch, n = self.input_batch, len(tokens.seq_ids)
        # (their newest token is an input)
        sampled = np.flatnonzero(tokens.real_ends == batch.num_tokens[tokens.rows])
        sample_rows = tokens.rows[sampled]
        hints = self._sampling_hints(sample_rows)
        verification, logits_rows, per_seq = None, sample_rows, None
        if tokens.num_drafts is not None:  # each sequence samples at its newest token and each proposal
            per_seq = 1 + tokens.num_drafts[sampled]
            logits_rows = np.repeat(sample_rows, per_seq)
            verification = Verification([tokens.seq_ids[i] for i in sampled.tolist()], sample_rows,
                                        [tokens.drafts[i] for i in sampled.tolist()], batch.record_verified)
        prefix_len = self._common_prefix_len(tokens)
        scoring = find_prompt_scoring(batch, tokens.seq_ids, tokens.rows, tokens.starts, tokens.ends,
                                      tokens.cu_query_lens)
        tail_sampling = hints if len(sampled) == n and scoring is None else None
        plan = self.plan(n, tokens.total, tail_sampling, prefix_len is not None, scoring is not None)
        arrays = self._host_inputs(tokens, plan, sampled, prefix_len)
        if scoring is not None:
            arrays.update(prompt_rows=scoring.rows, prompt_targets=scoring.targets)
        if not hints.all_greedy:
            num_outputs = batch.num_tokens[logits_rows] - batch.num_prompt[logits_rows]
            if per_seq is not None:
                num_outputs += _offsets_within(per_seq)  # (each draw's output number: its seed's)
            arrays.update(temperature=batch.temperature[logits_rows], top_k=batch.top_k[logits_rows],
                          top_p=batch.top_p[logits_rows], min_p=batch.min_p[logits_rows],
                          seeds=step_seeds(batch.seeds[logits_rows], num_outputs))
        sampled_seq_ids = tokens.seq_ids if len(sampled) == n else [tokens.seq_ids[i] for i in sampled.tolist()]
        inputs = self._upload(arrays, plan, tokens, sample_rows, sampled_seq_ids, hints, scoring)
        if verification is not None:
            inputs.verification, inputs.logits_rows = verification, logits_rows
        return inputs

    def _lay_out(self, step: SchedulerOutput) -> StepTokens:
        """The step's positions and slots; the sequences' computed tokens move past it."""
        batch, bs = self.input_batch, self.block_size
        seq_ids, n = step.seq_ids, len(step.seq_ids)
        num_new = np.array(step.num_new_tokens, dtype=np.int64)
        # A mixed step runs its one-token sequences first: attention sends them to the decode kernel as a block
        # (AttentionMetadata.num_decodes). Outputs name their sequences, so the order is the runner's own.
        num_decodes = int(np.count_nonzero(num_new == 1))
        if num_decodes == n:  # a decode step: its kernel takes them all
            num_decodes = 0
        elif num_decodes and not (num_new[:num_decodes] == 1).all():
            order = np.argsort(num_new > 1, kind="stable")
            seq_ids, num_new = [seq_ids[i] for i in order.tolist()], num_new[order]
        num_drafts, drafts = None, None
        if step.scheduled_spec_decode_tokens:
            drafts = [step.scheduled_spec_decode_tokens.get(i, []) for i in seq_ids]
            num_drafts = np.fromiter(map(len, drafts), dtype=np.int64, count=n)
        row_of = batch.row_of
        rows = np.fromiter((row_of[i] for i in seq_ids), dtype=np.int64, count=n)
        starts = batch.num_computed[rows]
        ends = starts + num_new
        batch.num_computed[rows] = ends
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(num_new, out=cu[1:])
        if cu[-1] == n:  # decode: one token per sequence
            positions, token_rows = starts, rows
        else:
            positions = np.arange(cu[-1], dtype=np.int64) - np.repeat(cu[:-1] - starts, num_new)
            token_rows = np.repeat(rows, num_new)
        slots = batch.block_tables[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        width = int((ends.max() + bs - 1) // bs)
        return StepTokens(seq_ids, rows, num_new, num_decodes, starts, ends, cu, positions, slots,
                          batch.block_tables[rows, :width], num_drafts, drafts)

    def _common_prefix_len(self, tokens: StepTokens) -> int | None:
        """A decode step whose sequences share a long enough prefix of blocks reads it once (cascade attention):
        its length in tokens, or None."""
        n, bs = len(tokens.seq_ids), self.block_size
        if not (self.config.cascade_attention and tokens.total == n
                and use_cascade_attention(self.max_blocks_per_seq * bs, n)):
            return None
        prefix_len = common_prefix_len(tokens.block_tables, tokens.ends, bs)
        return prefix_len if use_cascade_attention(prefix_len, n) else None

    def _host_inputs(self, tokens: StepTokens, plan: StepPlan, sampled: np.ndarray,
                     prefix_len: int | None) -> dict[str, np.ndarray]:
        """The model's inputs on the host, padded as the plan says. An input is a token sent with its sequence (a
        prompt chunk; after a preemption, outputs recomputed), or else its newest output, the one input of a
        decode: known on the host, or (async scheduling) sampled by the step before and not read back yet, then
        taken from that step's output on the device (where, the arrays say)."""
        batch, rows, cu, starts, ends = self.input_batch, tokens.rows, tokens.cu_query_lens, tokens.starts, tokens.ends
        ids = np.empty(tokens.total, dtype=np.int64)
        num_drafts, real_ends = tokens.num_drafts, tokens.real_ends
        last = cu[1:] - 1 if num_drafts is None else cu[1:] - 1 - num_drafts  # each sequence's last input of its own
        sent = real_ends <= batch.num_sent[rows]
        for i in np.flatnonzero(sent).tolist():
            ids[cu[i]:last[i] + 1] = batch.token_ids[rows[i]][starts[i]:real_ends[i]]
        newest = ~sent
        ids[last[newest]] = batch.last_token[rows[newest]]
        in_flight = newest & (starts == batch.num_known[rows])
        prev = self._last_output
        assert not newest.any() or (real_ends - starts)[newest].max() == 1, "an output is the input of one decode alone"
        assert not in_flight.any() or prev is not None, "a token in flight without the step that sampled it"
        logits_indices = last[sampled]
        if num_drafts is not None:  # the proposals follow their sequence's newest token, each position sampled
            for i in np.flatnonzero(num_drafts).tolist():
                ids[last[i] + 1:cu[i + 1]] = tokens.drafts[i]
            per_seq = 1 + num_drafts[sampled]
            logits_indices = np.repeat(logits_indices, per_seq) + _offsets_within(per_seq)
        if self.fixed_shapes and len(sampled):
            num_rows = next(r for r in self.logits_rows if r >= len(logits_indices))
            logits_indices = np.pad(logits_indices, (0, num_rows - len(logits_indices)))  # (row 0: any row will do)
        positions, slots = tokens.positions, tokens.slots
        if plan.num_tokens > tokens.total:
            extra = plan.num_tokens - tokens.total
            ids, positions = np.pad(ids, (0, extra)), np.pad(positions, (0, extra))
            slots = np.pad(slots, (0, extra), constant_values=-1)
        arrays = dict(input_ids=ids, positions=positions, slot_mapping=slots, logits_indices=logits_indices,
                      context_lens=ends.astype(np.int32), block_tables=tokens.block_tables)
        graph = plan.path is Path.DECODE_GRAPH
        if not graph:
            arrays.update(cu_query_lens=cu.astype(np.int32))
        if prefix_len is not None:
            arrays.update(common_prefix_len=np.array([prefix_len], dtype=np.int32))
        if in_flight.any() and graph:  # (a graph takes them from CudaGraphs.tokens, where prev left them)
            sources = np.full(len(rows), -1, dtype=np.int64)
            sources[in_flight] = prev.places(rows[in_flight])
            arrays.update(pending=sources)
        elif in_flight.any():
            arrays.update(pending_dst=last[in_flight], pending_src=prev.places(rows[in_flight]))
        return arrays

    def _upload(self, arrays: dict[str, np.ndarray], plan: StepPlan, tokens: StepTokens, sample_rows: np.ndarray,
                sampled_seq_ids: list[int], hints: SamplingTensors, scoring: PromptScoring | None) -> ModelInput:
        """The host inputs on the device in one copy: into a decode graph's own buffer, or the staging buffer's
        next slice (whose views are the step's tensors; with tensor parallelism, broadcast to the other ranks)."""
        num_sampled = len(sample_rows)
        if plan.path is Path.DECODE_GRAPH:
            graphs = self.cuda_graphs
            graphs.inputs.upload(self._staging, arrays)
            logits_indices = graphs.inputs.fields["logits_indices"][:len(arrays["logits_indices"])]
            return ModelInput(plan, None, None, None, logits_indices, sample_rows, sampled_seq_ids,
                              graphs.sampling(num_sampled, hints))
        buffer, layout = self._staging.upload(arrays)
        t = views(buffer, layout)
        if "pending_dst" in t:
            t["input_ids"][t["pending_dst"]] = self._last_output.token_ids[t["pending_src"]]
        max_query_len, max_context_len = int(tokens.num_new.max()), int(tokens.ends.max())
        if self.tp.size > 1:
            broadcast_step(buffer, layout, max_query_len, max_context_len, tokens.num_decodes, self.tp)
        meta = AttentionMetadata(cu_query_lens=t["cu_query_lens"], context_lens=t["context_lens"],
                                 block_tables=t["block_tables"], slot_mapping=t["slot_mapping"],
                                 max_query_len=max_query_len, max_context_len=max_context_len,
                                 common_prefix_len=t.get("common_prefix_len"), num_decodes=tokens.num_decodes)
        sampling = hints if hints.all_greedy else hints.with_tensors(t["temperature"], t["top_k"], t["top_p"],
                                                                      t["min_p"], t["seeds"])
        scoring_tensors = None if scoring is None else (t["prompt_rows"], t["prompt_targets"])
        return ModelInput(plan, t["input_ids"], t["positions"], meta, t["logits_indices"], sample_rows,
                          sampled_seq_ids, sampling, scoring, scoring_tensors)

    def _sampling_hints(self, rows: np.ndarray) -> SamplingTensors:
        """What the sampler must know of these rows' parameters to pick its path without reading anything back:
        SamplingTensors without the tensors (with_tensors adds them; an all-greedy step needs none)."""
        batch = self.input_batch
        needs = int(np.bitwise_or.reduce(batch.needs[rows])) if len(rows) else 0
        hints = SamplingTensors.greedy(any_penalties=bool(needs & PENALTIES), any_logprobs=bool(needs & LOGPROBS),
                                       any_min_tokens=bool(needs & MIN_TOKENS),
                                       any_structured=bool(needs & STRUCTURED))
        sampling = batch.temperature[rows] != 0
        if sampling.any():
            top_k, top_p, min_p = batch.top_k[rows], batch.top_p[rows], batch.min_p[rows]
            active_k = sampling & (top_k > 0) & (top_k < self.model_config.vocab_size)
            hints = dataclasses.replace(hints, all_greedy=False, use_top_p=bool((sampling & (top_p < 1)).any()),
                                        max_top_k=int(top_k[active_k].max()) if active_k.any() else 0,
                                        use_min_p=bool((sampling & (min_p > 0)).any()))
        return hints

    @torch.inference_mode()
    def execute_model(self, step: SchedulerOutput, record_gpu_time: bool = False) -> None:
        """Launch one step's forward pass (through the path its shape takes: a decode graph, the whole-step or
        piecewise graphs, or eager); sample_tokens() then samples its tokens. record_gpu_time: time the step on the
        device (CUDA events; on the CPU the host time is the device time, so nothing is recorded). A new sequence
        the runner cannot take in is a SequenceError, raised before anything runs."""
        timer = None
        if record_gpu_time and self.device.type == "cuda":
            timer = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            timer[0].record()
        inputs = self.prepare(step)
        plan, tokens = inputs.plan, None
        match plan.path:
            case Path.DECODE_GRAPH:
                hidden = self.cuda_graphs.replay(plan.graph_size, plan.shared_prefix, plan.tail)
                if plan.tail is not None:  # (it drew every sequence's token: a decode step samples them all)
                    hidden, tokens = None, hidden[:len(step.seq_ids)]
            case Path.WHOLE_GRAPH:
                hidden = self.piecewise_graphs.run_whole(inputs.input_ids, inputs.positions, inputs.meta)
            case Path.PIECEWISE:
                hidden = self.piecewise_graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
            case Path.EAGER:
                hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        self._executed = _Executed(inputs, hidden, tokens, timer)

    @torch.inference_mode()
    def sample_tokens(self, grammar: GrammarOutput | None = None) -> AsyncModelRunnerOutput:
        """The tokens of the step execute_model launched (a graph's tail may have drawn them already), on their way
        to the host; get() also records them in the runner's own histories. `grammar`: what the step's sequences
        under a grammar may draw (structured output)."""
        executed, self._executed = self._executed, None
        assert executed is not None, "sample_tokens() without execute_model()"
        inputs, timer, batch, graphs = executed.inputs, executed.timer, self.input_batch, self.cuda_graphs
        if executed.tokens is not None:  # the graph drew them
            output = self.sampler.output(executed.tokens, inputs.sampling, batch, inputs.sampled_rows,
                                         inputs.sampled_seq_ids, batch.record_tokens, timer)
            batch.num_tokens[inputs.sampled_rows] += 1
        elif inputs.verification is not None:  # (several rows a sequence: the accepted runs are counted when read)
            rows = inputs.logits_rows
            seq_ids = batch.seq_ids[rows].tolist()
            output = self.sample(executed.hidden[inputs.logits_indices], inputs.sampling, rows, seq_ids, timer,
                                 grammar, verifying=True)
            output.verification = inputs.verification
            batch.num_tokens[inputs.sampled_rows] += 1
        elif inputs.sampled_seq_ids:
            output = self.sample(executed.hidden[inputs.logits_indices], inputs.sampling, inputs.sampled_rows,
                                 inputs.sampled_seq_ids, timer, grammar)
            batch.num_tokens[inputs.sampled_rows] += 1  # the tokens in flight count from now on
            if graphs is not None:
                graphs.keep_tokens(output.token_ids)
        else:
            if timer is not None:
                timer[1].record()
            empty = torch.empty(0, dtype=torch.int64)
            output = AsyncModelRunnerOutput([], np.empty(0, dtype=np.int64), empty, empty, None, None, None, False,
                                            None, timer)
        if inputs.scoring is not None:
            rows, targets = inputs.scoring_tensors
            scores = score(self.model.compute_logits, executed.hidden[rows], targets, inputs.scoring.max_top_k,
                           self.model_config.vocab_size)
            assert scores is not None, "rank 0 gathers the logits"
            output.prompt_scores = (inputs.scoring, to_host(scores))
        self._last_output = output
        return output

    def sample(self, hidden: torch.Tensor, sampling: SamplingTensors, rows: np.ndarray, seq_ids: list[int],
               timer: tuple[torch.cuda.Event, torch.cuda.Event] | None = None,
               grammar: GrammarOutput | None = None, verifying: bool = False) -> AsyncModelRunnerOutput:
        """The next token of each sequence from the sampled positions' hidden states: row i of `hidden` is the
        input batch's row rows[i], sequence seq_ids[i], and rows past len(seq_ids) are padding (the LM head's
        fixed shapes), dropped. Logprobs, penalties and min_tokens go through the sampler's pass over the rows;
        other steps draw their tokens as the decode graphs' tail does (draw). verifying: the rows are a
        verification's, several a sequence, whose accepted runs the input batch records (Verification), not these."""
        batch, n = self.input_batch, len(seq_ids)
        on_ready = None if verifying else batch.record_tokens
        if sampling.needs_host_pass:
            logits = self.model.compute_logits(hidden)[:n]
            return self.sampler(logits, sampling, batch, rows, seq_ids, on_ready, timer, grammar)
        return self.sampler.output(self.draw(hidden, sampling, n), sampling, batch, rows, seq_ids, on_ready, timer)

    def draw(self, hidden: torch.Tensor, sampling: SamplingTensors, n: int | None = None) -> torch.Tensor:
        """The tokens of the first n rows of `hidden` (all: the decode CUDA graphs capture this as their tail),
        for a step without logprobs, penalties or min_tokens: greedy ones from the fused LM head where it applies,
        which writes no logits, else from the logits through the sampler (`sampling` has n rows)."""
        if not sampling.needs_logits:
            token_ids = self.model.greedy_tokens(hidden)
            if token_ids is not None:
                return token_ids[:n]
        return self.sampler.draw(self.model.compute_logits(hidden)[:n], sampling)

    # ---- tensor parallelism: rank 0 sends each step, the other ranks run it ---------------------------
    def stop_workers(self) -> None:
        """Rank 0: tell the other ranks' serve_steps loops to return."""
        broadcast_stop(self.tp, self.device)

    @torch.inference_mode()
    def serve_steps(self) -> None:
        """Ranks 1..N-1: run every step rank 0 broadcasts (the forward pass and this rank's share of the
        logits, those sampled and those of prompt logprobs, whose collectives pair with rank 0's), until it says
        stop."""
        while (received := receive_step(self.tp, self.device)) is not None:
            t, max_query_len, max_context_len, num_decodes = received
            meta = AttentionMetadata(t["cu_query_lens"], t["context_lens"], t["block_tables"], t["slot_mapping"],
                                     max_query_len, max_context_len, common_prefix_len=t.get("common_prefix_len"),
                                     num_decodes=num_decodes)
            hidden = self.model(t["input_ids"], t["positions"], meta)
            if t["logits_indices"].numel():
                self.model.compute_logits(hidden[t["logits_indices"]])
            if "prompt_rows" in t:  # (rank 0 scores them after its sampling)
                score(self.model.compute_logits, hidden[t["prompt_rows"]], t["prompt_targets"], 0,
                      self.model_config.vocab_size)
