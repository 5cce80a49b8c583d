"""Token embedding gather: out[t] = weight[input_ids[t]]."""

import torch

from tinyvllm.ops.pdl import pdl_options, pdl_wait
from tinyvllm.ops.triton_import import tl, triton


def embedding_ref(input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """input_ids [T] int, weight [V, H] -> [T, H]."""
    return weight[input_ids]


if triton is not None:

    # out[t, h0:h0+BLOCK] = weight[input_ids[t], h0:h0+BLOCK]; one program per (token, column tile).
    @triton.jit
    def _embedding_kernel(out_ptr, ids_ptr, weight_ptr, hidden, stride_w, stride_out, BLOCK: tl.constexpr,
                          USE_PDL: tl.constexpr):
        pdl_wait(USE_PDL)
        token = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < hidden
        row = tl.load(ids_ptr + token).to(tl.int64)
        values = tl.load(weight_ptr + row * stride_w + cols, mask=mask)
        tl.store(out_ptr + token.to(tl.int64) * stride_out + cols, values, mask=mask)


def embedding_triton(input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """input_ids [T] int, weight [V, H] -> [T, H]; the same gather as embedding_ref."""
    assert weight.stride(1) == 1, "embedding rows must be contiguous"
    ids = input_ids.reshape(-1).contiguous()
    hidden = weight.shape[1]
    out = torch.empty((ids.shape[0], hidden), dtype=weight.dtype, device=weight.device)
    if ids.shape[0] == 0:
        return out.reshape(*input_ids.shape, hidden)
    block = min(triton.next_power_of_2(hidden), 1024)
    grid = (ids.shape[0], triton.cdiv(hidden, block))
    _embedding_kernel[grid](out, ids, weight, hidden, weight.stride(0), out.stride(0), BLOCK=block,
                            **pdl_options(weight))
    return out.reshape(*input_ids.shape, hidden)
