"""A step's host arrays, by name, packed into one buffer and copied to the device in one transfer (and,
with tensor parallelism, broadcast to the other ranks as one tensor).

With tensor parallelism each step goes out as a fixed-size int64 header (what kind of message, the packed
buffer's size, the batch's two maxima, and for each array its field name's index in FIELDS, offset, dtype
and shape), then the packed buffer; the other ranks rebuild the named tensors from them.

On CUDA the buffer is pinned (allocating pinned memory per step costs more than the copy). There are two,
used in turn, so that step N+1 is packed while step N's copy may still wait in the stream (async
scheduling). Each copy records an event, and a buffer is written again only once its last copy is done:
reading a step's tokens back does not prove it (a step that samples nothing, a prompt chunk, has none to
read), and several such steps in a row would otherwise overwrite a buffer that a queued copy still reads.
A decode step that replays a CUDA graph packs its arrays in the graph's own fixed layout instead, and the copy
goes into the graph's input buffer (worker/cuda_graphs.py, DecodeInputs)."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist

from tinyvllm.distributed import TensorParallel

# Every array a step may carry, in a fixed order: the layout names each by its place here, so that the
# other tensor-parallel ranks read fields by name and a new field cannot shift the others.
FIELDS = ("input_ids", "positions", "slot_mapping", "logits_indices", "cu_query_lens", "context_lens",
          "block_tables", "pending_dst", "pending_src", "temperature", "top_k", "top_p", "min_p", "seeds",
          "common_prefix_len", "prompt_rows", "prompt_targets")
FIELD_INDEX = {name: i for i, name in enumerate(FIELDS)}

DTYPE_CODES = {np.dtype(np.int64): 0, np.dtype(np.int32): 1, np.dtype(np.float32): 2}
TORCH_DTYPES = [torch.int64, torch.int32, torch.float32]

# (field index, byte offset, dtype code, shape) of each array in a packed buffer
Layout = list[tuple[int, int, int, tuple[int, ...]]]


class Staging:
    # Every array starts 16-byte aligned: Triton specializes a kernel on whether each pointer argument is
    # a multiple of 16, so arrays at varying 8-byte offsets would compile new variants mid-run.
    ALIGN = 16

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers = [torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)]
        self._copied: list[torch.cuda.Event | None] = [None, None]  # each buffer's last copy to the device
        self._turn = 0

    @classmethod
    def layout(cls, arrays: dict[str, np.ndarray]) -> Layout:
        result, offset = [], 0
        for name, a in arrays.items():
            result.append((FIELD_INDEX[name], offset, DTYPE_CODES[a.dtype], a.shape))
            offset += -(-a.nbytes // cls.ALIGN) * cls.ALIGN
        return result

    def upload(self, arrays: dict[str, np.ndarray]) -> tuple[torch.Tensor, Layout]:
        """The packed device buffer and its layout (views() turns them into named tensors)."""
        layout = self.layout(arrays)
        last = layout[-1] if layout else None
        total = last[1] + math.prod(last[3]) * TORCH_DTYPES[last[2]].itemsize if last else 0
        host = self.host_buffer(total)
        for a, (_, offset, _, _) in zip(arrays.values(), layout):
            host[offset:offset + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        return self.send(total), layout

    def host_buffer(self, nbytes: int) -> np.ndarray:
        """The next pinned buffer (once its last copy is done), at least nbytes long, as bytes to pack into."""
        turn = self._turn
        copied = self._copied[turn]
        if copied is not None:
            copied.synchronize()  # (normally long done: two steps ago)
        buffer = self._buffers[turn]
        if buffer.numel() < nbytes:
            size = max(nbytes, 2 * buffer.numel())
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
            self._buffers[turn] = buffer
        return buffer.numpy()

    def send(self, nbytes: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy the first nbytes of the buffer host_buffer() gave to the device: into `out` (a uint8 device
        buffer), or a new tensor. Returns the device bytes (on the CPU, without `out`, the host buffer itself)."""
        turn = self._turn
        self._turn ^= 1
        buffer = self._buffers[turn][:nbytes]
        if out is not None:
            out = out[:nbytes]
            out.copy_(buffer, non_blocking=True)
        elif self.device.type != "cuda":  # the CPU runs the step from the buffer itself
            return buffer
        else:
            out = buffer.to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            self._copied[turn] = torch.cuda.Event()
            self._copied[turn].record()
        return out


def views(buffer: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """The named tensors of a packed buffer (views into it, no copy)."""
    result = {}
    for index, offset, code, shape in layout:
        dtype = TORCH_DTYPES[code]
        nbytes = math.prod(shape) * dtype.itemsize  # (not np.prod: this runs 14 times a step)
        view = buffer[offset:offset + nbytes].view(dtype)
        result[FIELDS[index]] = view if len(shape) == 1 else view.view(shape)
    return result


_HEADER_SIZE = 128
_STEP, _STOP = 1, 2
_FIELDS_PER_ARRAY = 6  # field index, offset, dtype code, ndim, and two dimensions


def broadcast_step(buffer: torch.Tensor, layout: Layout, max_query_len: int, max_context_len: int,
                   num_decodes: int, tp: TensorParallel) -> None:
    """Rank 0: send a step's packed inputs and its attention's Python ints to the other ranks."""
    fields = [_STEP, buffer.numel(), max_query_len, max_context_len, num_decodes, len(layout)]
    for index, offset, code, shape in layout:
        fields += [index, offset, code, len(shape), *shape, *[0] * (2 - len(shape))]
    header = torch.zeros(_HEADER_SIZE, dtype=torch.int64)
    header[: len(fields)] = torch.tensor(fields)
    dist.broadcast(header.to(buffer.device), src=0, group=tp.group)
    dist.broadcast(buffer, src=0, group=tp.group)


def broadcast_stop(tp: TensorParallel, device: torch.device) -> None:
    """Rank 0: tell the other ranks' step loops to return."""
    header = torch.zeros(_HEADER_SIZE, dtype=torch.int64, device=device)
    header[0] = _STOP
    dist.broadcast(header, src=0, group=tp.group)


def receive_step(tp: TensorParallel, device: torch.device) -> tuple[dict[str, torch.Tensor], int, int, int] | None:
    """Ranks 1..N-1: the next step's named inputs, its two maxima and its count of leading one-token sequences
    (AttentionMetadata's ints), or None when rank 0 says stop."""
    header = torch.empty(_HEADER_SIZE, dtype=torch.int64, device=device)
    dist.broadcast(header, src=0, group=tp.group)
    fields = header.tolist()
    if fields[0] == _STOP:
        return None
    total, max_query_len, max_context_len, num_decodes, num_arrays = fields[1:6]
    layout = []
    for i in range(num_arrays):
        index, offset, code, ndim, *shape = fields[6 + _FIELDS_PER_ARRAY * i:6 + _FIELDS_PER_ARRAY * (i + 1)]
        layout.append((index, offset, code, tuple(shape[:ndim])))
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=0, group=tp.group)
    return views(buffer, layout), max_query_len, max_context_len, num_decodes
