"""The ModelRunner owns the model and its KV cache. Each step it takes a SchedulerOutput (plain data),
updates its own state of the sequences it holds (input_batch.py), builds the batch's tensors, runs the
forward pass (through a CUDA graph for decode steps and for one sequence's prompt steps, and through graphs of
the pieces between attention calls for other steps of up to 8,192 tokens, when it can), and samples the next token
of every sequence whose last known token was in the step. It imports nothing from the engine."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from tinyvllm import ops
from tinyvllm.config import Config
from tinyvllm.contract import SchedulerOutput, SequenceError
from tinyvllm.distributed import TensorParallel
from tinyvllm.model.interface import CausalLM
from tinyvllm.ops import AttentionMetadata
from tinyvllm.ops.cascade_attention import common_prefix_len, use_cascade_attention
from tinyvllm.worker.cuda_graphs import CudaGraphs, PiecewiseCudaGraphs, size_ladder
from tinyvllm.worker.input_batch import LOGPROBS, MIN_TOKENS, PENALTIES, InputBatch
from tinyvllm.worker.kv_cache import allocate_kv_cache, decide_num_blocks
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


def padded_num_tokens(num_tokens: int, max_num_batched_tokens: int) -> int:
    """The token count a step is run at outside the CUDA graphs (see EAGER_TOKEN_MULTIPLE)."""
    if num_tokens <= EAGER_PADDING_ABOVE:
        return num_tokens
    multiple = EAGER_TOKEN_MULTIPLE
    if num_tokens > WARM_UP_MAX_TOKENS:
        multiple = max(multiple, (1 << (num_tokens - 1).bit_length()) // 16)
    rounded = -(-num_tokens // multiple) * multiple
    return max(num_tokens, min(rounded, max_num_batched_tokens))


@dataclass
class ModelInput:
    """A step's tensors on the device. A decode step that replays a CUDA graph has its inputs in the graph's own
    buffer (DecodeInputs), so only what comes after the graph is here."""

    input_ids: torch.Tensor | None  # (None: a graph step)
    positions: torch.Tensor | None
    meta: AttentionMetadata | None
    logits_indices: torch.Tensor  # rows of the hidden states whose next token is sampled
    # The input batch's rows of the sequences that sample, in that order; logits_indices may hold more (padding
    # rows, on CUDA, whose results are dropped).
    sampled_rows: np.ndarray
    sampled_seq_ids: list[int]
    sampling: SamplingTensors
    graph_size: int | None = None  # the decode graph's batch size, for a step that replays one
    shared_prefix: bool = False  # (a graph step) its inputs hold a common prefix length: cascade attention


@dataclass
class _Executed:
    """A step between execute_model and sample_tokens: its inputs, and the hidden states of its forward pass, or
    the tokens a decode graph's tail drew."""

    inputs: ModelInput
    hidden: torch.Tensor | None
    tokens: torch.Tensor | None
    timer: tuple[torch.cuda.Event, torch.cuda.Event] | None


class ModelRunner:
    def __init__(self, model: CausalLM, resolved: Config, tp: TensorParallel = TensorParallel()) -> None:
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
        self.num_blocks = decide_num_blocks(model, config, device, self.kv_cache_dtype, self.max_blocks_per_seq, tp)
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
            self.cuda_graphs = CudaGraphs(model, config.max_num_seqs, self.max_blocks_per_seq, self.block_size,
                                          model_config.hidden_size, dtype, device, config.cascade_attention,
                                          tail=self.draw)
            self.piecewise_graphs = PiecewiseCudaGraphs(model, config.max_num_batched_tokens, device,
                                                        self.cuda_graphs.pool, self.max_blocks_per_seq,
                                                        self.block_size)
        self.fixed_shapes = device.type == "cuda"  # (on the CPU shapes cost nothing: the batch runs as it is)
        self.logits_rows = size_ladder(config.max_num_seqs)  # (a step samples at most a row per sequence)
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
        sizes = sorted({padded_num_tokens(n, self.config.max_num_batched_tokens)
                        for n in range(EAGER_PADDING_ABOVE + 1, top + 1) if not self._runs_in_graphs(n)})
        for n in sizes:
            tokens = torch.zeros(n, dtype=torch.int64, device=self.device)
            meta = AttentionMetadata(empty, empty, empty.view(1, 1), torch.full_like(tokens, -1), 1, 1,
                                     attention=lambda q, *_: torch.zeros_like(q))
            self.model(tokens, tokens, meta)
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    # ---- one step ---------------------------------------------------------------------------------
    def _runs_in_graphs(self, num_tokens: int) -> bool:
        """A step with prompt tokens that the piecewise graphs take (at their own padded sizes)."""
        return self.piecewise_graphs is not None and self.piecewise_graphs.fits(num_tokens)

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
        for seq_id, block_ids in step.new_block_ids.items():
            batch.append_blocks(batch.row_of[seq_id], block_ids)

    def prepare(self, step: SchedulerOutput) -> ModelInput:
        """The step's tensors. An input token that the previous step sampled and the host has not read yet
        (async scheduling) is taken from that step's output on the device."""
        self._update_states(step)
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
        row_of = batch.row_of
        rows = np.fromiter((row_of[i] for i in seq_ids), dtype=np.int64, count=n)
        starts = batch.num_computed[rows]
        ends = starts + num_new
        batch.num_computed[rows] = ends
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(num_new, out=cu[1:])
        total = int(cu[-1])
        if total == n:  # decode: one token per sequence
            positions, token_rows = starts, rows
        else:
            positions = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1] - starts, num_new)
            token_rows = np.repeat(rows, num_new)
        slots = batch.block_tables[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        width = int((ends.max() + bs - 1) // bs)
        tables = batch.block_tables[rows, :width]

        # An input is a token sent with its sequence (a prompt chunk; after a preemption, outputs recomputed), or
        # else its newest output, the one input of a decode: known on the host, or (async scheduling) sampled by
        # the step before and not read back yet, then taken from that step's output on the device.
        ids = np.empty(total, dtype=np.int64)
        last = cu[1:] - 1  # each sequence's last input
        sent = ends <= batch.num_sent[rows]
        for i in np.flatnonzero(sent).tolist():
            ids[cu[i]:cu[i + 1]] = batch.token_ids[rows[i]][starts[i]:ends[i]]
        newest = ~sent
        ids[last[newest]] = batch.last_token[rows[newest]]
        in_flight = newest & (starts == batch.num_known[rows])
        prev = self._last_output
        assert not newest.any() or (num_new[newest] == 1).all(), "an output is the input of one decode alone"
        assert not in_flight.any() or prev is not None, "a token in flight without the step that sampled it"
        sampled = np.flatnonzero(ends == batch.num_tokens[rows])
        logits_indices = cu[1:][sampled] - 1
        padded = total
        if self.fixed_shapes:
            if len(sampled):
                num_rows = next(r for r in self.logits_rows if r >= len(sampled))
                logits_indices = np.pad(logits_indices, (0, num_rows - len(sampled)))  # (row 0: any row will do)
            if total > n and not self._runs_in_graphs(total):
                padded = padded_num_tokens(total, self.config.max_num_batched_tokens)
        sample_rows = rows[sampled]
        sampled_seq_ids = seq_ids if len(sampled) == n else [seq_ids[i] for i in sampled.tolist()]
        graphs = self.cuda_graphs
        graph_size = graphs.batch_size(n) if graphs is not None and total == n and graphs.fits(n) else None
        # The model's fields, then only when the step needs them (each costs host time on a slow CPU) the places
        # of the inputs in flight and the sampling parameters.
        if padded > total:
            extra = padded - total
            ids, positions = np.pad(ids, (0, extra)), np.pad(positions, (0, extra))
            slots = np.pad(slots, (0, extra), constant_values=-1)
        arrays = dict(input_ids=ids, positions=positions, slot_mapping=slots, logits_indices=logits_indices,
                      context_lens=ends.astype(np.int32), block_tables=tables)
        if graph_size is None:
            arrays.update(cu_query_lens=cu.astype(np.int32))
        # A decode step whose sequences share a long enough prefix of blocks reads it once (cascade attention).
        if self.config.cascade_attention and total == n and use_cascade_attention(self.max_blocks_per_seq * bs, n):
            prefix_len = common_prefix_len(tables, ends, bs)
            if use_cascade_attention(prefix_len, n):
                arrays.update(common_prefix_len=np.array([prefix_len], dtype=np.int32))
        pending = bool(in_flight.any())
        if pending and graph_size is not None:  # (a graph takes them from CudaGraphs.tokens, where prev left them)
            sources = np.full(n, -1, dtype=np.int64)
            sources[in_flight] = prev.places(rows[in_flight])
            arrays.update(pending=sources)
        elif pending:
            arrays.update(pending_dst=last[in_flight], pending_src=prev.places(rows[in_flight]))
        hints = self._sampling_hints(sample_rows)
        if not hints.all_greedy:
            num_outputs = batch.num_tokens[sample_rows] - batch.num_prompt[sample_rows]
            arrays.update(temperature=batch.temperature[sample_rows], top_k=batch.top_k[sample_rows],
                          top_p=batch.top_p[sample_rows], min_p=batch.min_p[sample_rows],
                          seeds=step_seeds(batch.seeds[sample_rows], num_outputs))
        if graph_size is not None:
            graphs.inputs.upload(self._staging, arrays)
            return ModelInput(None, None, None, graphs.inputs.fields["logits_indices"][:len(logits_indices)],
                              sample_rows, sampled_seq_ids, graphs.sampling(len(sampled), hints), graph_size,
                              "common_prefix_len" in arrays)
        buffer, layout = self._staging.upload(arrays)
        t = views(buffer, layout)
        if pending:
            t["input_ids"][t["pending_dst"]] = prev.token_ids[t["pending_src"]]
        max_query_len, max_context_len = int(num_new.max()), int(ends.max())
        if self.tp.size > 1:
            broadcast_step(buffer, layout, max_query_len, max_context_len, num_decodes, self.tp)
        meta = AttentionMetadata(cu_query_lens=t["cu_query_lens"], context_lens=t["context_lens"],
                                 block_tables=t["block_tables"], slot_mapping=t["slot_mapping"],
                                 max_query_len=max_query_len, max_context_len=max_context_len,
                                 common_prefix_len=t.get("common_prefix_len"), num_decodes=num_decodes)
        sampling = hints if hints.all_greedy else hints.with_tensors(t["temperature"], t["top_k"], t["top_p"],
                                                                      t["min_p"], t["seeds"])
        return ModelInput(t["input_ids"], t["positions"], meta, t["logits_indices"], sample_rows, sampled_seq_ids,
                          sampling)

    def _sampling_hints(self, rows: np.ndarray) -> SamplingTensors:
        """What the sampler must know of these rows' parameters to pick its path without reading anything back:
        SamplingTensors without the tensors (with_tensors adds them; an all-greedy step needs none)."""
        batch = self.input_batch
        needs = int(np.bitwise_or.reduce(batch.needs[rows])) if len(rows) else 0
        hints = SamplingTensors.greedy(any_penalties=bool(needs & PENALTIES), any_logprobs=bool(needs & LOGPROBS),
                                       any_min_tokens=bool(needs & MIN_TOKENS))
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
        if step.scheduled_spec_decode_tokens:
            raise NotImplementedError("the model runner does not verify proposed tokens yet")
        timer = None
        if record_gpu_time and self.device.type == "cuda":
            timer = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            timer[0].record()
        inputs = self.prepare(step)
        graphs, pieces = self.cuda_graphs, self.piecewise_graphs
        num_seqs, tokens = len(step.seq_ids), None
        if inputs.graph_size is not None:
            # (a decode step samples every sequence, so the graph's rows are the sampled ones, in order)
            mode = graphs.tail_mode(inputs.sampling) if len(inputs.sampled_seq_ids) == num_seqs else None
            hidden = graphs.replay(inputs.graph_size, inputs.shared_prefix, mode)
            if mode is not None:
                hidden, tokens = None, hidden[:num_seqs]
        elif pieces is not None and pieces.fits_whole(num_seqs, inputs.input_ids.shape[0]):
            hidden = pieces.run_whole(inputs.input_ids, inputs.positions, inputs.meta)
        elif self._runs_in_graphs(inputs.input_ids.shape[0]):
            hidden = pieces.run(inputs.input_ids, inputs.positions, inputs.meta)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        self._executed = _Executed(inputs, hidden, tokens, timer)

    @torch.inference_mode()
    def sample_tokens(self) -> AsyncModelRunnerOutput:
        """The tokens of the step execute_model launched (a graph's tail may have drawn them already), on their way
        to the host; get() also records them in the runner's own histories."""
        executed, self._executed = self._executed, None
        assert executed is not None, "sample_tokens() without execute_model()"
        inputs, timer, batch, graphs = executed.inputs, executed.timer, self.input_batch, self.cuda_graphs
        if executed.tokens is not None:  # the graph drew them
            output = self.sampler.output(executed.tokens, inputs.sampling, batch, inputs.sampled_rows,
                                         inputs.sampled_seq_ids, batch.record_tokens, timer)
            batch.num_tokens[inputs.sampled_rows] += 1
        elif inputs.sampled_seq_ids:
            output = self.sample(executed.hidden[inputs.logits_indices], inputs.sampling, inputs.sampled_rows,
                                 inputs.sampled_seq_ids, timer)
            batch.num_tokens[inputs.sampled_rows] += 1  # the tokens in flight count from now on
            if graphs is not None:
                graphs.keep_tokens(output.token_ids)
        else:
            if timer is not None:
                timer[1].record()
            empty = torch.empty(0, dtype=torch.int64)
            output = AsyncModelRunnerOutput([], np.empty(0, dtype=np.int64), empty, empty, None, None, None, False,
                                            None, timer)
        self._last_output = output
        return output

    def sample(self, hidden: torch.Tensor, sampling: SamplingTensors, rows: np.ndarray, seq_ids: list[int],
               timer: tuple[torch.cuda.Event, torch.cuda.Event] | None = None) -> AsyncModelRunnerOutput:
        """The next token of each sequence from the sampled positions' hidden states: row i of `hidden` is the
        input batch's row rows[i], sequence seq_ids[i], and rows past len(seq_ids) are padding (the LM head's
        fixed shapes), dropped. Logprobs, penalties and min_tokens go through the sampler's pass over the rows;
        other steps draw their tokens as the decode graphs' tail does (draw)."""
        batch, n = self.input_batch, len(seq_ids)
        if sampling.needs_host_pass:
            logits = self.model.compute_logits(hidden)[:n]
            return self.sampler(logits, sampling, batch, rows, seq_ids, batch.record_tokens, timer)
        return self.sampler.output(self.draw(hidden, sampling, n), sampling, batch, rows, seq_ids,
                                   batch.record_tokens, timer)

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
        logits, whose collectives pair with rank 0's), until it says stop."""
        while (received := receive_step(self.tp, self.device)) is not None:
            t, max_query_len, max_context_len, num_decodes = received
            meta = AttentionMetadata(t["cu_query_lens"], t["context_lens"], t["block_tables"], t["slot_mapping"],
                                     max_query_len, max_context_len, common_prefix_len=t.get("common_prefix_len"),
                                     num_decodes=num_decodes)
            hidden = self.model(t["input_ids"], t["positions"], meta)
            if t["logits_indices"].numel():
                self.model.compute_logits(hidden[t["logits_indices"]])
