"""The staging buffers on a GPU: a step's host arrays are never overwritten while their copy to the device is
still queued, however many steps come before the host reads anything back (prompt chunks sample nothing, so no
token read waits for the stream). The stream is held busy by a sleep kernel while three steps are packed.

    python -m pytest -m cuda tests/gpu/test_staging_cuda.py -ra      (on a GPU machine; skipped elsewhere)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tinyvllm.worker.staging import Staging, views

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_a_buffer_is_not_rewritten_before_its_copy_ran() -> None:
    staging = Staging(torch.device("cuda"))
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time in front of the copies
    uploads = [staging.upload({"input_ids": np.full(1 << 16, step, dtype=np.int64)}) for step in range(3)]
    torch.cuda.synchronize()
    got = [int(views(buffer, layout)["input_ids"].unique().item()) for buffer, layout in uploads]
    assert got == [0, 1, 2], f"the device copies hold {got}: a buffer was rewritten under a queued copy"
