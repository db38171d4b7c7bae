"""The top-k order of tied logits is defined: descending logit, equal logits by ascending token id, also where a
tie crosses the k-th place (apcscore.kernels.logprobs_torch.top_k, used by the torch reference and the Triton
path alike). CUDA's torch.topk orders ties differently from the CPU's, which made the GPU kernel test fail."""

from __future__ import annotations

import pytest
import torch

from apcscore.kernels.logprobs_torch import top_k, token_logprobs_torch


def stable_order(logits: torch.Tensor, k: int) -> torch.Tensor:
    return torch.sort(-logits.float(), dim=-1, stable=True).indices[:, :k]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ties_are_ordered_by_token_id(dtype: torch.dtype) -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, -1.0, 3.0],   # four-way tie at the top
                           [5.0, 0.0, 5.0, 5.0, 1.0, 1.0, 1.0],    # tie at the top, then a tie across k=4
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],    # all equal
                           [float("-inf")] * 5 + [1.0, 1.0]], dtype=dtype)
    for k in range(0, 8):
        values, ids = top_k(logits, k)
        assert torch.equal(ids, stable_order(logits, k)), k
        assert torch.equal(values, logits.gather(1, ids))
    assert top_k(logits, 2)[1].tolist() == [[1, 2], [0, 2], [0, 1], [5, 6]]
    assert top_k(logits, 4)[1][1].tolist() == [0, 2, 3, 4]  # the tie of 1.0 at 4, 5, 6 keeps the lowest id
    assert torch.equal(top_k(logits, 1)[1][:, 0], logits.argmax(dim=-1))  # top-1 is argmax: its first maximum


def test_random_ties_match_a_stable_sort() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 6, (64, 300), generator=g).float()  # many ties everywhere
    targets = torch.randint(0, 300, (64,), generator=g)
    for k in (1, 5, 20):
        for reuse_buffers in (False, True):
            _, _, ids, top_lp = token_logprobs_torch(logits, targets, k, reuse_buffers=reuse_buffers)
            assert torch.equal(ids, stable_order(logits, k))
            assert torch.all(top_lp[:, :-1] >= top_lp[:, 1:])
