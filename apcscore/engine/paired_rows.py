"""The reference model's side of the logprob step (engine/reference.py): for each chunk of scored rows, the
reference's logits of the same rows beside the model's, reduced per row to the exact divergence
(kernels/divergence_torch.row_divergence) while both chunks are alive: O(chunk x vocab), never O(rows x vocab)."""

from __future__ import annotations

from typing import Callable

import torch

from apcscore.engine.step import Divergence
from apcscore.kernels.divergence_torch import row_divergence


class PairedRows:
    """The `beside` of chunked_token_logprobs: the reference's logits of each chunk's rows and their divergence."""

    def __init__(self, compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor) -> None:
        """compute_logits(h [n, H]) -> the reference's fp32 logits [n, V]; hidden: the reference's final hidden
        states [N, H] of the same rows, in the same order, as the model's."""
        self.compute_logits, self.hidden = compute_logits, hidden
        self.parts: list[tuple[torch.Tensor, ...]] = []

    def __call__(self, start: int, logits: torch.Tensor, targets: torch.Tensor) -> None:
        n = targets.shape[0]
        ref_logits = self.compute_logits(self.hidden[start:start + n])  # [n, V] fp32
        self.parts.append(row_divergence(logits[:n], ref_logits[:n], targets))

    def result(self) -> Divergence:
        kl, ref_lp, delta_p, agree = (torch.cat([p[i] for p in self.parts]).cpu().numpy() for i in range(4))
        return Divergence(ref_logprobs=ref_lp, kl=kl, delta_p=delta_p, top1_agree=agree)
