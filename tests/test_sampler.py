"""The sampler reads nothing back from the device (issue 15, item 3): one token tensor for the whole batch,
read by the model runner in one transfer, instead of one `.item()` per sampled row. Its tokens are those of
the per-row sampler it replaced, bitwise, for the same seeds."""

from __future__ import annotations

import pytest
import torch

from apcscore.engine.sampler import make_generator, sample_rows
from apcscore.engine.sampling_params import SamplingParams


def per_row_reference(logits: torch.Tensor, params: list[SamplingParams], gens: list) -> list[int]:
    """The sampler before batching: one `.item()` per sampled row."""
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for i, p in enumerate(params):
        if p.temperature == 0:
            out.append(greedy[i])
            continue
        row = logits[i].float() / p.temperature
        if p.top_k > 0 and p.top_k < row.shape[0]:
            kth = row.topk(p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = row.sort(descending=True)
            probs = sorted_logits.softmax(-1)
            drop = (probs.cumsum(-1) - probs) >= p.top_p
            row = row.scatter(0, order[drop], float("-inf"))
        out.append(int(torch.multinomial(row.softmax(-1), 1, generator=gens[i]).item()))
    return out


PARAMS = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=5),
          SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.3, top_k=50, top_p=0.5),
          SamplingParams(temperature=0.0, top_k=3)]


def generators(seed: int) -> list:
    return [make_generator(seed + i, torch.device("cpu")) if p.temperature > 0 else None
            for i, p in enumerate(PARAMS)]


@pytest.mark.parametrize("seed", range(5))
def test_batched_sampler_equals_the_per_row_one(seed: int) -> None:
    logits = 3 * torch.randn(len(PARAMS), 500, generator=torch.Generator().manual_seed(seed))
    gens_ref, gens = generators(seed), generators(seed)
    for _ in range(3):  # the generators advance alike, step after step
        got = sample_rows(logits, PARAMS, gens)
        assert got.dtype == torch.int64 and got.shape == (len(PARAMS),)
        assert got.tolist() == per_row_reference(logits, PARAMS, gens_ref)


def test_sampler_reads_nothing_back(monkeypatch) -> None:
    logits = torch.randn(len(PARAMS), 300, generator=torch.Generator().manual_seed(0))
    gens = generators(0)

    def no_read(*args, **kwargs):
        raise AssertionError("the sampler read a value back from the device")

    for method in ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, method, no_read)
    tokens = sample_rows(logits, PARAMS, gens)
    monkeypatch.undo()
    assert tokens.tolist() == per_row_reference(logits, PARAMS, generators(0))


@pytest.mark.parametrize("top_p", [1e-300, 1e-46, 5e-324])
def test_a_top_p_that_rounds_to_zero_keeps_the_top_token(top_p: float) -> None:
    """Issue 46, item 4: a top_p in (0, 1] that is 0 in fp32 dropped every token, and multinomial raised on the
    NaN row (a traceback, the whole run lost). The top token stays, as in vLLM: the row is sampled greedily."""
    logits = 3 * torch.randn(4, 300, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.0, top_p=top_p), SamplingParams(temperature=0.5, top_k=7, top_p=top_p),
              SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=0.0)]
    gens = [make_generator(i, torch.device("cpu")) for i in range(4)]
    got = sample_rows(logits, params, gens).tolist()
    greedy = logits.argmax(-1).tolist()
    assert got[:2] == greedy[:2] and got[3] == greedy[3]
