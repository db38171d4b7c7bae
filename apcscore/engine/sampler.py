"""Next-token sampling: greedy at temperature 0, else temperature, top-k, top-p, per-request seeds.

Each sampled request owns a torch.Generator seeded from its `seed` (or from the engine seed and its
arrival number), so a seeded completion is the same whatever else shares the batch.

On the CPU a token is drawn by inverse transform sampling, with the same bits on every machine: the
probabilities are apcscore's portable softmax (apcscore.kernels.rowmath), their running sums are
`numpy.add.accumulate` in float64 (sequential by its definition: r[i] = r[i-1] + p[i]), and one float64 uniform u
from the request's generator picks the first token whose running sum exceeds u times the total. (torch.multinomial
would draw through torch's exp/log kernels, whose bits follow the CPU.) On CUDA, torch.multinomial.
"""

from __future__ import annotations

import numpy as np
import torch

from apcscore.kernels import rowmath

from apcscore.engine.step import SamplingParams


def sampling_seed(params: SamplingParams, engine_seed: int, arrival: int) -> int:
    """The seed of a sampled request's RNG in both engines: its own `seed`, else one from the engine seed and its
    arrival number; as an unsigned 64-bit int (what torch's manual_seed takes)."""
    seed = params.seed if params.seed is not None else hash((engine_seed, arrival))
    return seed & 0xFFFF_FFFF_FFFF_FFFF


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
                ) -> torch.Tensor:
    """logits [B, V] (fp32) -> one token id per row, [B] int64 on the logits' device.

    Nothing here waits for the device: sampled rows are written into the greedy result as tensors, so the
    caller reads all B tokens with one transfer (`.tolist()`) instead of one `.item()` per row.
    """
    tokens = logits.argmax(dim=-1)  # [B]; greedy rows keep theirs
    for i, p in enumerate(params):
        if p.temperature == 0:
            continue
        row = logits[i].float() / p.temperature  # [V]
        if p.top_k > 0 and p.top_k < row.shape[0]:
            kth = row.topk(p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if rowmath.ours(row):
            tokens[i] = _draw_portable(row, p.top_p, generators[i])
            continue
        if p.top_p < 1.0:
            sorted_logits, order = row.sort(descending=True)
            probs = sorted_logits.softmax(-1)
            # drop a token when the mass before it already reaches top_p; the top token always stays, also when
            # top_p rounds to 0 in fp32 (1e-300 passes the (0, 1] check), as in vLLM
            drop = (probs.cumsum(-1) - probs) >= p.top_p
            drop[0] = False
            row = torch.empty_like(row).scatter_(0, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = row.softmax(-1)
        tokens[i] = torch.multinomial(probs, 1, generator=generators[i])[0]
    return tokens


def _draw_portable(row: torch.Tensor, top_p: float, generator: torch.Generator | None) -> int:
    """One token of a CPU row of (scaled, top-k masked) logits [V]: top-p, then inverse transform sampling."""
    if top_p < 1.0:
        # descending logits, equal ones by ascending id (a stable sort: no order left to the algorithm)
        sorted_logits, order = row.sort(descending=True, stable=True)
        probs = rowmath.softmax(sorted_logits).double().numpy()
        before = np.add.accumulate(probs) - probs  # the mass before each token (float64)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop = torch.from_numpy(before >= top_p)
        row = torch.empty_like(row).scatter_(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    cumulative = np.add.accumulate(rowmath.softmax(row).double().numpy())  # [V] float64
    u = float(torch.rand(1, dtype=torch.float64, generator=generator))
    token = int(np.searchsorted(cumulative, u * cumulative[-1], side="right"))  # first running sum > u * total
    return min(token, int(np.flatnonzero(np.diff(cumulative, prepend=0.0))[-1]))  # never past the last token
