"""Next-token sampling: greedy at temperature 0, else temperature, top-k, top-p, per-request seeds.

Each sampled request owns a torch.Generator seeded from its `seed` (or from the engine seed and its
arrival number), so a seeded completion is the same whatever else shares the batch.
"""

from __future__ import annotations

import torch

from apcscore.engine.sampling_params import SamplingParams


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return gen


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
