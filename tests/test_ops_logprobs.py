"""The token logprobs op (ops/logprobs.py: prompt logprobs and sampled tokens' logprobs) against its reference, the
float32 log-softmax that scoring computed before it, under the Triton interpreter on small CPU tensors: ties, -inf,
a target that is the row's max, rows whose top k keeps changing, k = 0, 1, 5, one tile and several."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tinyvllm.ops.logprobs import token_logprobs_ref, token_logprobs_triton  # noqa: E402

pytestmark = pytest.mark.usefixtures("poison_outputs")  # (conftest: unwritten outputs show as NaN, or -1)


def _hard_rows(vocab: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Eight rows of `vocab` logits that make the op's corner cases, and each row's target."""
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(8, vocab, generator=generator) * 4
    targets = torch.randint(0, vocab, (8,), generator=generator)
    targets[1] = int(logits[1].argmax())  # the target is the max: rank 1
    logits[2] = logits[2].round()  # many ties, the target's among them (a tie is not ranked above it)
    logits[3, : vocab // 2] = float("-inf")  # half the row impossible, the target among them
    targets[3] = 1
    logits[4] = float("-inf")  # three possible tokens: the top 5 ends in -inf, taken by lowest id
    logits[4, [vocab - 1, 3, vocab // 2]] = torch.tensor([1.0, 2.0, 1.0])
    targets[4] = vocab - 1
    logits[5] = torch.linspace(-5, 5, vocab)  # rising: every tile beats the kept top k
    logits[6] = 0.0  # all equal: rank 1, the top k the lowest ids
    logits[7, [10, vocab - 2]] = logits[7].max() + 1  # two tied maxima, far apart
    targets[7] = vocab - 2
    return logits.to(dtype), targets


def _stable_top(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """The top k ids in the kernel's order: larger logits first, of equal ones the lower id."""
    return torch.sort(logits.float(), dim=1, descending=True, stable=True).indices[:, :top_k]


@pytest.mark.parametrize("vocab", [300, 5000])  # one tile; several, the last partial
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [0, 1, 5])
def test_token_logprobs(vocab: int, dtype: torch.dtype, top_k: int) -> None:
    logits, targets = _hard_rows(vocab, dtype)
    expected = torch.log_softmax(logits.float(), dim=-1)
    want_chosen = expected.gather(1, targets[:, None]).squeeze(1)
    want_ranks = (expected > want_chosen[:, None]).sum(dim=1) + 1
    want_lse = torch.logsumexp(logits.float(), dim=-1)
    for op in (token_logprobs_ref, token_logprobs_triton):
        chosen, ranks, lse, top_ids, top_logprobs = op(logits, targets, top_k)
        torch.testing.assert_close(chosen, want_chosen, atol=2e-5, rtol=1e-6)
        assert ranks.dtype == torch.int32 and ranks.tolist() == want_ranks.tolist(), op.__name__
        torch.testing.assert_close(lse, want_lse, atol=2e-5, rtol=1e-6)
        assert top_ids.shape == top_logprobs.shape == (8, top_k) and top_ids.dtype == torch.int64
        torch.testing.assert_close(top_logprobs, expected.topk(top_k, dim=1).values, atol=2e-5, rtol=1e-6)
        # Each id's own logprob is the one reported (ties may come in any order from torch.topk)
        torch.testing.assert_close(expected.gather(1, top_ids), top_logprobs, atol=2e-5, rtol=1e-6)
        assert all(len(set(row)) == top_k for row in top_ids.tolist())
    assert top_ids.tolist() == _stable_top(logits, top_k).tolist()  # (the kernel's: ties by lower id)
    assert ranks[[1, 6]].tolist() == [1, 1]


def test_token_logprobs_of_no_rows() -> None:
    empty = torch.zeros(0, 300)
    for op in (token_logprobs_ref, token_logprobs_triton):
        outputs = op(empty, torch.zeros(0, dtype=torch.int64), 3)
        assert [tuple(t.shape) for t in outputs] == [(0,), (0,), (0,), (0, 3), (0, 3)]


def test_token_logprobs_reads_strided_rows() -> None:
    """Rows of a wider buffer (the sliced logits of a padded vocabulary) as the rows alone."""
    wide = torch.randn(3, 520)
    targets = torch.tensor([0, 499, 250])
    for got, want in zip(token_logprobs_triton(wide[:, :500], targets, 2),
                         token_logprobs_ref(wide[:, :500].contiguous(), targets, 2)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-6)
