"""The sampler. On CUDA (its torch path, run here with the portable path switched off) it reads nothing back from
the device (issue 15, item 3): one token tensor for the whole batch, read by the model runner in one transfer,
and its tokens are those of the per-row sampler it replaced, bitwise, for the same seeds. On the CPU it draws by
inverse transform sampling with portable bits (issue 39): checked against a plain-Python derivation of the same
rule, and against the probabilities themselves (frequencies, the top-p nucleus)."""

from __future__ import annotations

import itertools

import pytest
import torch

from apcscore.engine.sampler import sample_rows
from apcscore.engine.step import SamplingParams
from apcscore.kernels import rowmath


@pytest.fixture
def torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler's torch path (CUDA's), on CPU tensors."""
    monkeypatch.setattr(rowmath, "ours", lambda x: False)


def per_row_reference(logits: torch.Tensor, params: list[SamplingParams], gens: list) -> list[int]:
    """The torch path before batching: one `.item()` per sampled row."""
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
    return [torch.Generator().manual_seed(seed + i) if p.temperature > 0 else None
            for i, p in enumerate(PARAMS)]


def inverse_transform_reference(logits: torch.Tensor, params: list[SamplingParams], gens: list) -> list[int]:
    """The CPU rule in plain Python: top-k, top-p on running float64 sums of the sorted probabilities, then the
    first token whose running sum exceeds u * total (u: one float64 uniform from the request's generator)."""
    out = []
    for i, p in enumerate(params):
        if p.temperature == 0:
            out.append(int(logits[i].argmax()))
            continue
        row = logits[i].float() / p.temperature
        if p.top_k > 0 and p.top_k < row.shape[0]:
            row = row.masked_fill(row < row.topk(p.top_k).values[-1], float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = row.sort(descending=True, stable=True)
            probs = rowmath.softmax(sorted_logits).double().tolist()
            before = [c - q for c, q in zip(itertools.accumulate(probs), probs)]
            for j, b in enumerate(before):
                if b >= p.top_p:
                    row[order[j]] = float("-inf")
        running = list(itertools.accumulate(rowmath.softmax(row).double().tolist()))
        u = float(torch.rand(1, dtype=torch.float64, generator=gens[i]))
        out.append(next(j for j, c in enumerate(running) if c > u * running[-1]))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_cpu_sampler_is_inverse_transform_sampling(seed: int) -> None:
    logits = 3 * torch.randn(len(PARAMS), 500, generator=torch.Generator().manual_seed(seed))
    gens_ref, gens = generators(seed), generators(seed)
    for _ in range(3):  # the generators advance alike, step after step
        got = sample_rows(logits, PARAMS, gens)
        assert got.dtype == torch.int64 and got.shape == (len(PARAMS),)
        assert got.tolist() == inverse_transform_reference(logits, PARAMS, gens_ref)


def test_cpu_sampler_draws_by_the_probabilities() -> None:
    """Frequencies of 4,000 draws over 5 tokens are within 4 standard errors of softmax(logits); top_p keeps the
    nucleus only (tokens sorted by probability 0.64, 0.24, 0.09, ...: top_p 0.8 keeps two)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -2.0]])
    probs = torch.softmax(logits[0].double(), -1)
    gen = torch.Generator().manual_seed(7)
    counts = torch.zeros(5)
    for _ in range(4000):
        counts[sample_rows(logits, [SamplingParams(temperature=1.0)], [gen])[0]] += 1
    stderr = (probs * (1 - probs) / 4000).sqrt()
    assert ((counts / 4000 - probs).abs() <= 4 * stderr + 1e-9).all(), (counts / 4000, probs)
    nucleus = {int(sample_rows(logits, [SamplingParams(temperature=1.0, top_p=0.8)], [gen])[0]) for _ in range(500)}
    assert nucleus == {0, 1}


@pytest.mark.parametrize("seed", range(5))
def test_batched_sampler_equals_the_per_row_one(seed: int, torch_path: None) -> None:
    logits = 3 * torch.randn(len(PARAMS), 500, generator=torch.Generator().manual_seed(seed))
    gens_ref, gens = generators(seed), generators(seed)
    for _ in range(3):  # the generators advance alike, step after step
        got = sample_rows(logits, PARAMS, gens)
        assert got.dtype == torch.int64 and got.shape == (len(PARAMS),)
        assert got.tolist() == per_row_reference(logits, PARAMS, gens_ref)


def test_sampler_reads_nothing_back(monkeypatch, torch_path: None) -> None:
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
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    got = sample_rows(logits, params, gens).tolist()
    greedy = logits.argmax(-1).tolist()
    assert got[:2] == greedy[:2] and got[3] == greedy[3]
