"""`apcscore compare`: the KL estimator, the metrics, the comparability checks, the CLI gate and its reports.

The result files are written here with pyarrow in the schema `apcscore score` writes (`write_results`), from a
tiny random "language model" evaluated in float32 and in bfloat16, so that divergences are real, not typed in.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import typer
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from apcscore.compare.command import compare
from apcscore.compare.gate import compare_files
from apcscore.compare.thresholds import Thresholds, load_thresholds
from apcscore.compare.kl_bound import TopKLogprobs, kl_divergence_topk, solve_unknown_masses
from apcscore.errors import ApcscoreError

VOCAB = 50
REPO = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------------------------------------------------
# Fixture writer: the parquet schema of `apcscore score`
# ---------------------------------------------------------------------------------------------------------

SCORE_SCHEMA = pa.schema([
    ("id", pa.string()), ("status", pa.string()), ("error", pa.string()),
    ("num_tokens", pa.int64()), ("num_scored", pa.int64()), ("sum_logprob", pa.float64()),
    ("mean_nll", pa.float64()), ("perplexity", pa.float64()),
    ("token_ids", pa.list_(pa.int64())), ("token_logprobs", pa.list_(pa.float32())),
    ("token_ranks", pa.list_(pa.int64())), ("top_ids", pa.list_(pa.list_(pa.int64()))),
    ("top_logprobs", pa.list_(pa.list_(pa.float32()))),
    ("choice_logprobs", pa.list_(pa.float64())), ("choice_logprobs_norm", pa.list_(pa.float64())),
    ("pred", pa.int64()), ("pred_norm", pa.int64()), ("correct", pa.bool_()), ("correct_norm", pa.bool_()),
    ("answer", pa.int64()),
])

PERPLEXITY_SCHEMA = pa.schema([
    ("id", pa.string()), ("status", pa.string()), ("error", pa.string()), ("num_tokens", pa.int64()),
    ("num_words", pa.int64()), ("num_bytes", pa.int64()), ("sum_logprob", pa.float64()),
    ("perplexity", pa.float64()), ("word_perplexity", pa.float64()), ("byte_perplexity", pa.float64()),
    ("bits_per_byte", pa.float64()),
])


def write_results(path: Path, rows: list[dict], *, command: str = "score", dtype: str = "float32",
                  vocab_size: int | None = VOCAB, dataset_sha256: str = "ab" * 32, drop: tuple[str, ...] = (),
                  metadata: bool = True, schema: pa.Schema = SCORE_SCHEMA, job: dict | None = None,
                  meta: dict | None = None) -> Path:
    """Write rows (dicts; missing keys are null) as an apcscore result file with its `apcscore` metadata (`meta`:
    more top-level keys, or keys that replace these)."""
    meta = {"apcscore_version": "0.1.0", "command": command, "dtype": dtype,
            "model": {"name": "tiny-random", **({"vocab_size": vocab_size} if vocab_size else {})},
            "dataset": {"path": "data.jsonl", "sha256": dataset_sha256}, **({"job": job} if job else {}),
            **(meta or {})}
    schema = pa.schema([f for f in schema if f.name not in drop])
    table = pa.Table.from_pylist([{k: r.get(k) for k in schema.names} for r in rows], schema=schema)
    if metadata:
        table = table.replace_schema_metadata({b"apcscore": json.dumps(meta).encode()})
    pq.write_table(table, path)
    return path


# ---------------------------------------------------------------------------------------------------------
# A tiny real computation: a random causal "LM" in float32 and in bfloat16
# ---------------------------------------------------------------------------------------------------------


class TinyLM:
    """Next-token log-probabilities from a causal mean of embeddings and two projections."""

    def __init__(self, vocab: int = VOCAB, dim: int = 32, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.randn(vocab, dim, generator=g)  # [V, D]
        self.w = torch.randn(dim, dim, generator=g) / dim**0.5  # [D, D]
        self.out = 4 * torch.randn(dim, vocab, generator=g) / dim**0.5  # [D, V]

    def logprobs(self, tokens: list[int], dtype: torch.dtype) -> torch.Tensor:
        """[L, V] float32 log-softmax of the next-token logits after each prefix, computed in `dtype`."""
        x = self.emb.to(dtype)[torch.tensor(tokens)]  # [L, D]
        prefix_mean = x.cumsum(0) / torch.arange(1, len(tokens) + 1, dtype=dtype)[:, None]  # [L, D]
        logits = torch.tanh(prefix_mean @ self.w.to(dtype)) @ self.out.to(dtype)  # [L, V]
        return torch.log_softmax(logits.float(), dim=-1)


def make_records(n: int = 8, seed: int = 1) -> dict[str, list[int]]:
    rng = np.random.default_rng(seed)
    return {f"r{i}": rng.integers(0, VOCAB, int(rng.integers(12, 40))).tolist() for i in range(n)}


def score_rows(model: TinyLM, records: dict[str, list[int]], dtype: torch.dtype, k: int) -> list[dict]:
    """Rows as `apcscore score --prompt-logprobs k` writes them (position 0 null)."""
    rows = []
    for rid, toks in records.items():
        lp = model.logprobs(toks, dtype)  # [L, V]
        prev, tgt = lp[:-1], torch.tensor(toks[1:])  # [L-1, V], [L-1]
        own = prev.gather(1, tgt[:, None])[:, 0]  # [L-1]
        ranks = 1 + (prev > own[:, None]).sum(1)  # [L-1]
        top = prev.topk(k, dim=1) if k else None
        s = float(own.double().sum())
        rows.append({
            "id": rid, "status": "ok", "num_tokens": len(toks), "num_scored": len(toks) - 1, "sum_logprob": s,
            "mean_nll": -s / (len(toks) - 1), "perplexity": math.exp(-s / (len(toks) - 1)),
            "token_ids": toks, "token_logprobs": [None] + own.tolist(), "token_ranks": [None] + ranks.tolist(),
            "top_ids": [None] + (top.indices.tolist() if k else [[] for _ in toks[1:]]),
            "top_logprobs": [None] + (top.values.tolist() if k else [[] for _ in toks[1:]]),
        })
    return rows


def exact_kl(model: TinyLM, records: dict[str, list[int]]) -> np.ndarray:
    """Per-position KL(fp32 || bf16) over the whole vocabulary, float64, in file order."""
    out = []
    for toks in records.values():
        p = model.logprobs(toks, torch.float32)[:-1].double()
        q = model.logprobs(toks, torch.bfloat16)[:-1].double()
        out.append((p.exp() * (p - q)).sum(1).numpy())
    return np.concatenate(out)


@pytest.fixture(scope="module")
def tiny() -> tuple[TinyLM, dict[str, list[int]]]:
    return TinyLM(), make_records()


def run_cli(*args: str | Path, columns: int = 200):
    app = typer.Typer()
    app.command("compare")(compare)
    app.callback()(lambda: None)  # keep `compare` a subcommand, as in the real app
    return CliRunner().invoke(app, ["compare", *map(str, args)], env={"COLUMNS": str(columns)})


def one_line(text: str) -> str:
    return " ".join(text.split())


# ---------------------------------------------------------------------------------------------------------
# The KL estimator
# ---------------------------------------------------------------------------------------------------------


def side(lp: np.ndarray, k: int, target: np.ndarray) -> TopKLogprobs:
    """What a file with top-k stores about the [n, V] log-distributions lp."""
    order = np.argsort(-lp, axis=1, kind="stable")[:, :k]
    return TopKLogprobs(target, lp[np.arange(len(lp)), target], order, np.take_along_axis(lp, order, 1))


def random_pair(rng: np.random.Generator, n: int, v: int, scale: float, noise: float):
    z = rng.normal(size=(n, v)) * scale
    z2 = z + rng.normal(size=(n, v)) * noise
    lp = z - np.logaddexp.reduce(z, axis=1, keepdims=True)
    lq = z2 - np.logaddexp.reduce(z2, axis=1, keepdims=True)
    return lp, lq, (np.exp(lp) * (lp - lq)).sum(1), rng.integers(0, v, n)


def test_kl_exact_when_k_covers_vocabulary() -> None:
    lp, lq, exact, tgt = random_pair(np.random.default_rng(0), 500, 7, 2.0, 1.0)
    est = kl_divergence_topk(side(lp, 7, tgt), side(lq, 7, tgt), vocab_size=7)
    np.testing.assert_allclose(est, exact, rtol=1e-12, atol=1e-14)
    assert exact.min() > 1e-3  # a real divergence, not trivially zero
    # Without the vocabulary size it is exact up to the float32-rounding allowance.
    est_unknown_v = kl_divergence_topk(side(lp, 7, tgt), side(lq, 7, tgt), vocab_size=None)
    np.testing.assert_allclose(est_unknown_v, exact, atol=1e-5)


def test_kl_of_identical_sides_is_zero() -> None:
    lp, _, _, tgt = random_pair(np.random.default_rng(1), 300, 40, 3.0, 0.0)
    for k in (1, 5, 40):
        assert np.all(kl_divergence_topk(side(lp, k, tgt), side(lp, k, tgt), 40) == 0.0)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), v=st.integers(2, 30), k_base=st.integers(1, 30), k_new=st.integers(1, 30),
       scale=st.floats(0.1, 6.0), noise=st.floats(0.0, 3.0))
def test_kl_is_a_lower_bound(seed: int, v: int, k_base: int, k_new: int, scale: float, noise: float) -> None:
    lp, lq, exact, tgt = random_pair(np.random.default_rng(seed), 40, v, scale, noise)
    est = kl_divergence_topk(side(lp, min(k_base, v), tgt), side(lq, min(k_new, v), tgt), v)
    assert np.all(est >= 0)
    assert np.all(est <= exact + 1e-9)


def test_kl_bound_is_attained_by_a_consistent_pair() -> None:
    """The estimate is the KL of a pair of full distributions that store exactly the same top-K: it is the
    tightest lower bound, not just a lower bound."""
    rng = np.random.default_rng(3)
    v, k, n = 1000, 4, 200
    lp, lq, exact, tgt = random_pair(rng, n, v, 3.0, 1.5)
    b, w = side(lp, k, tgt), side(lq, k, tgt)
    est = kl_divergence_topk(b, w, v)
    checked = 0
    for i in range(n):
        known_p = {**dict(zip(b.top_ids[i].tolist(), np.exp(b.top_logprobs[i]))),
                   int(tgt[i]): math.exp(b.target_logprobs[i])}
        known_q = {**dict(zip(w.top_ids[i].tolist(), np.exp(w.top_logprobs[i]))),
                   int(tgt[i]): math.exp(w.target_logprobs[i])}
        a_ids = [t for t in known_p if t not in known_q]
        b_ids = [t for t in known_q if t not in known_p]
        if not a_ids and not b_ids:
            continue
        tail_p, tail_q = 1 - sum(known_p.values()), 1 - sum(known_q.values())
        a = np.array([[known_p[t] for t in a_ids] + [0.0] * (k - len(a_ids))])  # [1, k], zero-padded
        bq = np.array([[known_q[t] for t in b_ids] + [0.0] * (k - len(b_ids))])
        cap_q, cap_p = np.exp(w.top_logprobs[i, -1:]), np.exp(b.top_logprobs[i, -1:])  # the K-th probabilities
        x, y, pr, qr = solve_unknown_masses(a, cap_q, bq, cap_p, np.array([tail_p]), np.array([tail_q]))
        # The witness pair: known values, the solved unknowns, the bucket spread evenly over the other tokens.
        rest = [t for t in range(v) if t not in known_p and t not in known_q]
        p = np.full(v, pr[0] / len(rest))
        q = np.full(v, qr[0] / len(rest))
        for t, val in known_p.items():
            p[t] = val
        for t, val in known_q.items():
            q[t] = val
        for j, t in enumerate(a_ids):
            q[t] = x[0, j]
        for j, t in enumerate(b_ids):
            p[t] = y[0, j]
        assert p.sum() == pytest.approx(1, abs=1e-9) and q.sum() == pytest.approx(1, abs=1e-9)
        # Consistent with what the files store: same top-k sets and values (ties allowed at the cut).
        for dist, stored in ((p, b), (q, w)):
            kth = np.sort(dist)[-k]
            assert np.all(np.isin(stored.top_ids[i], np.flatnonzero(dist >= kth - 1e-12)))
            assert np.sort(dist)[-k - 1] <= kth + 1e-12
        witness = float((p * np.log(p / q)).sum())
        assert witness == pytest.approx(est[i], rel=1e-6, abs=1e-9)
        assert est[i] <= exact[i] + 1e-9
        checked += 1
    assert checked > 50


def _objective(a, x, y, b, tail_p, tail_q):
    with np.errstate(divide="ignore", invalid="ignore"):
        pr, qr = np.maximum(tail_p - y, 0), np.maximum(tail_q - x, 0)
        bucket = np.where(pr > 1e-12, pr * np.log(pr / qr), 0.0)
        return a * np.log(a / x) + np.where(y > 0, y * np.log(y / b), 0.0) + bucket


@settings(max_examples=40, deadline=None)
@given(a=st.floats(0.05, 0.6), b=st.floats(0.05, 0.6), cap_q=st.floats(0.01, 0.5), cap_p=st.floats(0.01, 0.5),
       tail_p=st.floats(0.01, 0.4), tail_q=st.floats(0.01, 0.4))
def test_unknown_masses_minimize_the_divergence(a, b, cap_q, cap_p, tail_p, tail_q) -> None:
    """One base-only and one new-only token: the solution is feasible and no point of a fine grid does better."""
    x, y, pr, qr = (v[0] if v.ndim == 1 else v[0, 0] for v in solve_unknown_masses(
        np.array([[a]]), np.array([cap_q]), np.array([[b]]), np.array([cap_p]), np.array([tail_p]), np.array([tail_q])))
    assert 0 < x <= min(cap_q, tail_q) + 1e-12 and 0 <= y <= min(cap_p, tail_p) + 1e-12
    assert pr == pytest.approx(max(tail_p - y, 0), abs=1e-9) and qr == pytest.approx(max(tail_q - x, 0), abs=1e-9)
    gx = np.linspace(1e-9, min(cap_q, tail_q), 801)[:, None]  # [801, 1]
    gy = np.linspace(0, min(cap_p, tail_p), 801)[None, :]  # [1, 801]
    grid = _objective(a, gx, gy, b, tail_p, tail_q)
    assert _objective(a, x, y, b, tail_p, tail_q) <= np.nanmin(grid) + 1e-9


def test_unknown_masses_with_an_empty_bucket() -> None:
    """Neither tail can hold what the other side's known token needs: the bucket is empty, x and y fill the
    tails (KL = 0.3 ln(0.3/0.1) + 0.1 ln(0.1/0.3))."""
    x, y, pr, qr = solve_unknown_masses(np.array([[0.3]]), np.array([0.2]), np.array([[0.3]]), np.array([0.2]),
                                        np.array([0.1]), np.array([0.1]))
    assert (x[0, 0], y[0, 0], pr[0], qr[0]) == pytest.approx((0.1, 0.1, 0.0, 0.0), abs=1e-12)
    p = np.log([0.3, 0.6, 0.1])  # tokens 0 (top of base), 1 (top of both), 2 = a rest token
    q = np.log([0.1, 0.6, 0.3])
    est = kl_divergence_topk(TopKLogprobs(np.array([1]), p[[1]], np.array([[1, 0]]), p[None, [1, 0]]),
                             TopKLogprobs(np.array([1]), q[[1]], np.array([[1, 2]]), q[None, [1, 2]]), vocab_size=None)
    assert est[0] == pytest.approx(0.3 * math.log(3) + 0.1 * math.log(1 / 3), rel=1e-9)


def test_kl_stays_finite_and_a_bound_when_float32_rounding_eats_the_tail() -> None:
    """New's top-2 sum to 1 - 2e-8, which float32 logprobs round to >= 1: its tail reads as 0."""
    v = 1000
    q = np.full(v, 2e-8 / (v - 2))
    q[0], q[1] = 0.58, 0.42 - 2e-8  # float32 rounds both logprobs up
    p = np.full(v, 0.4 / (v - 3))
    p[0], p[1], p[2] = 0.05, 0.05, 0.5  # base's top token 2 is outside new's top-2
    lp, lq = np.log(p)[None], np.log(q)[None]
    tgt = np.array([0])
    b, n = side(lp, 2, tgt), side(lq, 2, tgt)
    n.top_logprobs = n.top_logprobs.astype(np.float32).astype(np.float64)
    assert 1 - np.exp(n.top_logprobs).sum() <= 0  # the tail is lost to rounding
    est = kl_divergence_topk(b, n, v)[0]
    exact = float((p * np.log(p / q)).sum())
    assert 1 < est <= exact


# ---------------------------------------------------------------------------------------------------------
# fp32 vs bf16 of the tiny model
# ---------------------------------------------------------------------------------------------------------


LARGE_K_UNDER_A_MEMORY_CAP = """
import resource, sys
import numpy as np
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))  # 1 GiB of address space for this process
from apcscore.compare.kl_bound import TopKLogprobs, kl_divergence_topk
rng = np.random.default_rng(0)
n, k, v = 280, 4096, 20000
def side(lp, target):
    top = np.argsort(-lp, axis=1, kind="stable")[:, :k]
    return TopKLogprobs(target, np.take_along_axis(lp, target[:, None], 1)[:, 0], top, np.take_along_axis(lp, top, 1))
def log_softmax(x):
    x = x - x.max(1, keepdims=True)
    return x - np.log(np.exp(x).sum(1, keepdims=True))
lp = log_softmax(2 * rng.normal(size=(n, v)))
lq = log_softmax(lp + 0.3 * rng.normal(size=(n, v)))
target = rng.integers(0, v, n)
kl = kl_divergence_topk(side(lp, target), side(lq, target), v)
exact = (np.exp(lp) * (lp - lq)).sum(1)
assert kl.shape == (n,) and np.isfinite(kl).all() and (kl >= 0).all() and (kl <= exact + 1e-9).all(), kl
print("ok", float(kl.mean()), float(exact.mean()))
"""


def test_kl_bound_of_a_large_top_k_fits_in_a_small_memory(tmp_path) -> None:
    """Issue 46, item 2: the bound matched the two sides' known tokens in an [n, K+1, K+1] array: K = 4096 over
    280 positions needed ~5 GB (compare was killed at 24 GB on a 9-token file at K = 49152). Matching by one
    sort is O(n x K): the same case runs under a 1 GiB address-space cap, and stays a lower bound of the KL."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", LARGE_K_UNDER_A_MEMORY_CAP], capture_output=True, text=True,
                         env={"PYTHONPATH": str(REPO), "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"},
                         timeout=300)
    assert res.returncode == 0 and res.stdout.startswith("ok"), res.stderr[-2000:]


COMPARE_UNDER_A_MEMORY_CAP = """
import resource, sys
import pyarrow as pa
pa.set_cpu_count(1); pa.set_io_thread_count(1)  # each thread reserves address space of its own
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
from apcscore.cli import main
sys.argv = ["apcscore", "compare", *sys.argv[1:]]
main()
"""


@pytest.mark.slow
def test_compare_of_top_4096_files_runs_under_a_memory_cap(tmp_path) -> None:
    """Issue 46, item 2, end to end: `apcscore compare` of two files scored at top-4096 (276 positions) under a
    3 GiB address-space cap. The [n, K+1, K+1] matching asked for 4.3 GiB at once and was refused there."""
    import subprocess
    import sys

    rng, noise = np.random.default_rng(0), np.random.default_rng(1)
    k, v, length = 4096, 20_000, 70
    rows: dict[str, list[dict]] = {"a": [], "b": []}
    for r in range(4):
        ids = rng.integers(0, v, length).tolist()
        sides = {name: ([None], [None], [None]) for name in rows}
        for p in range(1, length):
            base = 2 * rng.normal(size=v)
            for name, lp in (("a", base), ("b", base + 0.1 * noise.normal(size=v))):
                lp = lp - lp.max() - np.log(np.exp(lp - lp.max()).sum())
                top = np.argsort(-lp, kind="stable")[:k]
                sides[name][0].append(float(lp[ids[p]]))
                sides[name][1].append(top.tolist())
                sides[name][2].append(lp[top].tolist())
        for name, (target, top_ids, top_lp) in sides.items():
            total = float(sum(target[1:]))
            rows[name].append({"id": f"r{r}", "status": "ok", "num_tokens": length, "num_scored": length - 1,
                               "sum_logprob": total, "mean_nll": -total / (length - 1),
                               "perplexity": math.exp(-total / (length - 1)), "token_ids": ids,
                               "token_logprobs": target, "token_ranks": [None] + [1] * (length - 1),
                               "top_ids": top_ids, "top_logprobs": top_lp})
    a, b = (write_results(tmp_path / f"{name}.parquet", rows[name], vocab_size=v) for name in rows)
    res = subprocess.run([sys.executable, "-c", COMPARE_UNDER_A_MEMORY_CAP, str(a), str(b), "--max-mean-kld", "1",
                          "--no-default-gate"],  # about memory: random distributions, not a model change
                         capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(REPO), "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
                              "COLUMNS": "200"})
    assert res.returncode == 0 and "PASS" in res.stdout, (res.stdout[-1500:], res.stderr[-1500:])


@pytest.fixture(scope="module")
def fp32_bf16(tiny, tmp_path_factory) -> tuple[Path, Path, Path, Path]:
    model, records = tiny
    d = tmp_path_factory.mktemp("runs")
    return (
        write_results(d / "fp32_k5.parquet", score_rows(model, records, torch.float32, 5)),
        write_results(d / "bf16_k5.parquet", score_rows(model, records, torch.bfloat16, 5), dtype="bfloat16"),
        write_results(d / "fp32_kv.parquet", score_rows(model, records, torch.float32, VOCAB)),
        write_results(d / "bf16_kv.parquet", score_rows(model, records, torch.bfloat16, VOCAB), dtype="bfloat16"),
    )


def test_large_top_k_files_are_read_in_smaller_chunks_with_the_same_figures(fp32_bf16, monkeypatch) -> None:
    """At a large K the positions read at once shrink, so that a chunk holds at most _CHUNK_ENTRIES top-K entries
    per side (the figures stay those of one chunk)."""
    from apcscore.compare import metrics

    whole = compare_files(fp32_bf16[2], fp32_bf16[3]).metrics
    monkeypatch.setattr(metrics, "_CHUNK_ENTRIES", 3 * VOCAB)  # K = VOCAB: 3 positions per chunk (whole records)
    chunked = compare_files(fp32_bf16[2], fp32_bf16[3]).metrics
    assert chunked.num_positions == whole.num_positions and chunked.top1_agreement == whole.top1_agreement
    assert chunked.kld.mean == pytest.approx(whole.kld.mean, rel=1e-12)
    assert chunked.kld.max == pytest.approx(whole.kld.max, rel=1e-12)


def test_file_against_itself(fp32_bf16) -> None:
    base = fp32_bf16[0]
    c = compare_files(base, base)
    m = c.metrics
    assert m.kld.mean == 0 and m.kld.max == 0
    assert m.ppl_ratio == 1 and m.mean_ln_ppl_ratio == 0 and m.max_abs_logprob_diff == 0
    assert m.top1_agreement == 1 and m.rms_delta_p == 0
    r = run_cli(base, base, "--max-mean-kld", 0, "--max-ppl-ratio", 1, "--min-top1-agreement", 1,
                "--max-abs-logprob-diff", 0)
    assert r.exit_code == 0, r.output
    assert "PASS" in r.output


def test_fp32_vs_bf16_kl_is_small_positive_and_matches_the_full_vocabulary(tiny, fp32_bf16) -> None:
    model, records = tiny
    exact = exact_kl(model, records)
    c5 = compare_files(fp32_bf16[0], fp32_bf16[1])
    cv = compare_files(fp32_bf16[2], fp32_bf16[3])
    assert c5.metrics.num_positions == len(exact)
    assert 0 < exact.mean() < 0.05  # bf16 noise: small but real
    # K = vocab: the stored float32 logprobs give the exact KL.
    assert cv.metrics.kld.mean == pytest.approx(exact.mean(), rel=1e-4)
    assert cv.metrics.kld.max == pytest.approx(exact.max(), rel=1e-4)
    # K = 5: a lower bound that still sees most of it.
    assert 0.5 * exact.mean() < c5.metrics.kld.mean <= exact.mean() * (1 + 1e-6)
    assert c5.metrics.kld.percentiles["50"] <= c5.metrics.kld.percentiles["99"] <= c5.metrics.kld.max
    # Top-1 agreement: the argmax sets of the full distributions intersect (bf16 ties count as agreement).
    same = []
    for toks in records.values():
        p = model.logprobs(toks, torch.float32)[:-1]
        q = model.logprobs(toks, torch.bfloat16)[:-1]
        same += ((p == p.max(1, keepdim=True).values) & (q == q.max(1, keepdim=True).values)).any(1).tolist()
    assert c5.metrics.top1_agreement == pytest.approx(np.mean(same))
    assert cv.metrics.top1_agreement == c5.metrics.top1_agreement
    # PPL ratio from the per-token logprobs agrees with the per-record sums.
    rows32 = score_rows(model, records, torch.float32, 0)
    rows16 = score_rows(model, records, torch.bfloat16, 0)
    nll = [sum(-r["sum_logprob"] for r in rows) / sum(r["num_scored"] for r in rows) for rows in (rows32, rows16)]
    assert c5.metrics.ppl_ratio == pytest.approx(math.exp(nll[1] - nll[0]), rel=1e-6)


def test_fp32_vs_bf16_gate(fp32_bf16, tmp_path) -> None:
    base, new = fp32_bf16[:2]
    r = run_cli(base, new, "--max-mean-kld", 0)
    assert r.exit_code == 1, r.output
    assert "FAIL" in r.output
    md, js = tmp_path / "r.md", tmp_path / "r.json"
    r = run_cli(base, new, "--max-mean-kld", 0.05, "--max-ppl-ratio", 1.1, "--min-top1-agreement", 0.5,
                "--max-abs-logprob-diff", 2, "--report-md", md, "--report-json", js)
    assert r.exit_code == 0, r.output
    data = json.loads(js.read_text())
    # 4 given + --max-new-errors 0 and --max-broken 0 (the defaults; the default accuracy limit needs choices)
    assert data["passed"] is True and len(data["checks"]) == 6
    assert 0 < data["metrics"]["kld"]["mean"] < 0.05
    assert list(data["metrics"]["kld"]["percentiles"]) == ["99.9", "99", "95", "90", "50", "10", "5", "1", "0.1"]
    assert len(data["records"]) == 8 and data["records"][0]["mean_kld"] >= data["records"][-1]["mean_kld"]
    text = md.read_text()
    assert text.startswith("## apcscore compare: ✅ PASS") and "| --max-mean-kld |" in text
    kld_lines = text.split("### KL(base || new)")[1].splitlines()
    assert kld_lines[2] == ("| positions | mean | +/- SE | max | 99.9% | 99% | 95% | 90% | 50% | 10% | 5% | 1% | 0.1% "
                            "| min |")
    kld = data["metrics"]["kld"]
    assert kld_lines[4].startswith(f"| {kld['num_positions']} | {kld['mean']:.6g} |")


def test_a_report_never_replaces_an_input_or_a_file_that_is_not_a_report(fp32_bf16, tmp_path) -> None:
    """Issue 46, item 1: `--report-json A` replaced the baseline A with JSON and passed."""
    base, new = fp32_bf16[:2]
    before = Path(base).read_bytes()
    for opt in ("--report-json", "--report-md", "--report-html"):
        r = run_cli(base, new, opt, base, "--overwrite")
        assert r.exit_code == 2, r.output
        assert f"{opt} {base} is the baseline file itself" in one_line(r.output)
    assert Path(base).read_bytes() == before
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "keep me"}\n')
    r = run_cli(base, new, "--report-md", data)
    assert r.exit_code == 2 and "exists and is not a report of apcscore compare — pass --overwrite" in one_line(
        r.output)
    assert data.read_text() == '{"prompt": "keep me"}\n'
    r = run_cli(base, new, "--report-junit", tmp_path, "--overwrite")
    assert r.exit_code == 2 and f"--report-junit {tmp_path} is a directory — give a file name" in one_line(r.output)
    r = run_cli(base, new, "--report-md", tmp_path / "r", "--report-json", tmp_path / "r")
    assert r.exit_code == 2 and "--report-md and --report-json are both" in one_line(r.output)
    md, js, html = tmp_path / "r.md", tmp_path / "r.json", tmp_path / "r.html"
    md.touch()  # an empty file such as $GITHUB_STEP_SUMMARY
    for _ in range(2):  # an earlier report is replaced without --overwrite
        r = run_cli(base, new, "--report-md", md, "--report-json", js, "--report-html", html)
        assert r.exit_code == 0, r.output
    assert run_cli(base, new, "--report-md", data, "--overwrite").exit_code == 0
    assert data.read_text().startswith("## apcscore compare:")


def test_vocab_size_missing_from_metadata_is_inferred(tiny, tmp_path) -> None:
    model, records = tiny
    a = write_results(tmp_path / "a.parquet", score_rows(model, records, torch.float32, VOCAB), vocab_size=None)
    b = write_results(tmp_path / "b.parquet", score_rows(model, records, torch.bfloat16, VOCAB), vocab_size=None)
    c = compare_files(a, b)
    assert c.vocab_size == VOCAB and c.vocab_size_inferred
    assert any("at least 50" in n for n in c.notes)
    assert c.metrics.kld.mean == pytest.approx(exact_kl(model, records).mean(), rel=1e-3)


def test_records_are_matched_by_id_not_order(tiny, tmp_path) -> None:
    model, records = tiny
    rows = score_rows(model, records, torch.bfloat16, 5)
    a = write_results(tmp_path / "a.parquet", score_rows(model, records, torch.float32, 5))
    b = write_results(tmp_path / "b.parquet", rows)
    c = write_results(tmp_path / "c.parquet", rows[::-1])
    assert compare_files(a, b).to_dict()["metrics"] == compare_files(a, c).to_dict()["metrics"]


# ---------------------------------------------------------------------------------------------------------
# Files that cannot be compared: exit 2
# ---------------------------------------------------------------------------------------------------------


def test_different_datasets_exit_2(tiny, tmp_path) -> None:
    model, records = tiny
    base = write_results(tmp_path / "a.parquet", score_rows(model, records, torch.float32, 5))
    other = write_results(tmp_path / "b.parquet", score_rows(model, make_records(6, seed=9), torch.float32, 5),
                          dataset_sha256="cd" * 32)
    r = run_cli(base, other)
    assert r.exit_code == 2
    assert "different datasets" in one_line(r.stderr)
    # Same hash in the metadata, but other record ids.
    renamed = [dict(row, id=f"x{i}") for i, row in enumerate(score_rows(model, records, torch.float32, 5))]
    r = run_cli(base, write_results(tmp_path / "c.parquet", renamed))
    assert r.exit_code == 2
    assert "only in the baseline ('r0', 'r1'" in one_line(r.stderr)


def test_other_tokenizer_exit_2(tiny, tmp_path) -> None:
    model, records = tiny
    changed = dict(records, r3=[t if i != 4 else (t + 1) % VOCAB for i, t in enumerate(records["r3"])])
    base = write_results(tmp_path / "a.parquet", score_rows(model, records, torch.float32, 5))
    new = write_results(tmp_path / "b.parquet", score_rows(model, changed, torch.float32, 5))
    r = run_cli(base, new)
    assert r.exit_code == 2
    assert "tokenized differently" in r.stderr and "'r3'" in r.stderr and "position 4" in one_line(r.stderr)


def test_not_apcscore_output_exit_2(fp32_bf16, tmp_path) -> None:
    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"id": ["a"], "status": ["ok"]}), plain)
    r = run_cli(fp32_bf16[0], plain)
    assert r.exit_code == 2 and "not apcscore output" in r.stderr
    text = tmp_path / "x.parquet"
    text.write_text("not parquet")
    assert run_cli(fp32_bf16[0], text).exit_code == 2
    assert "does not exist" in one_line(run_cli(fp32_bf16[0], tmp_path / "missing.parquet").stderr)


def test_threshold_needing_a_missing_column_exit_2(tiny, tmp_path) -> None:
    model, records = tiny
    drop = ("top_ids", "top_logprobs")
    base = write_results(tmp_path / "a.parquet", score_rows(model, records, torch.float32, 0), drop=drop)
    new = write_results(tmp_path / "b.parquet", score_rows(model, records, torch.bfloat16, 0), drop=drop)
    r = run_cli(base, new, "--max-mean-kld", 0.1)
    assert r.exit_code == 2
    assert "--prompt-logprobs K" in one_line(r.stderr)
    # Without the KL threshold the rest still works, and says why KL is missing.
    r = run_cli(base, new, "--max-ppl-ratio", 1.1)
    assert r.exit_code == 0, r.output
    assert "KL and top-1 agreement not computed" in one_line(r.output)
    # K = 0 stored (empty top lists) is the same situation.
    base0 = write_results(tmp_path / "c.parquet", score_rows(model, records, torch.float32, 0))
    r = run_cli(base0, base0, "--min-top1-agreement", 0.9)
    assert r.exit_code == 2 and "needs top_ids" in one_line(r.stderr)
    r = run_cli(base, new, "--max-accuracy-drop", 0.01)
    assert r.exit_code == 2 and "no multiple-choice records" in one_line(r.stderr)


def test_the_note_names_the_file_without_token_ids(tiny, tmp_path) -> None:
    """Without token ids on one side the tokenizers are compared by token counts, and the note says which file
    lacks them (not "no token_ids in the files" when one has them)."""
    model, records = tiny
    both = write_results(tmp_path / "a.parquet", score_rows(model, records, torch.float32, 0))
    bare = write_results(tmp_path / "b.parquet", score_rows(model, records, torch.float32, 0), drop=("token_ids",))
    assert any("no token_ids in the candidate file" in n for n in compare_files(both, bare).notes)
    assert any("no token_ids in the files" in n for n in compare_files(bare, bare).notes)


def test_bad_threshold_values_exit_2(fp32_bf16) -> None:
    r = run_cli(fp32_bf16[0], fp32_bf16[1], "--min-top1-agreement", 1.5)
    assert r.exit_code == 2 and "--min-top1-agreement must be" in one_line(r.stderr)


# ---------------------------------------------------------------------------------------------------------
# Error records, multiple choice, perplexity files, config
# ---------------------------------------------------------------------------------------------------------


def test_error_records_are_listed_and_excluded(tiny, tmp_path) -> None:
    model, records = tiny
    rows32 = score_rows(model, records, torch.float32, 5)
    rows16 = score_rows(model, records, torch.bfloat16, 5)
    rows32[2] = {"id": "r2", "status": "error", "error": "prompt too long (40 > 32 tokens)"}
    rows16[5] = {"id": "r5", "status": "error", "error": "bad field 'text'"}
    rows32[6] = rows16[6] = {"id": "r6", "status": "error", "error": "empty prompt"}
    c = compare_files(write_results(tmp_path / "a.parquet", rows32), write_results(tmp_path / "b.parquet", rows16))
    assert [(e.id, e.side) for e in c.excluded] == [("r2", "baseline"), ("r5", "candidate"), ("r6", "both")]
    assert c.excluded[0].error == "prompt too long (40 > 32 tokens)"
    assert c.num_records == 8 and c.num_compared == 5
    assert {r.id for r in c.records} == {f"r{i}" for i in range(8)} - {"r2", "r5", "r6"}
    kept = [i for i in range(8) if i not in (2, 5, 6)]
    nll = [sum(-rows[i]["sum_logprob"] for i in kept) / sum(rows[i]["num_scored"] for i in kept) for rows in
           (score_rows(*tiny, torch.float32, 0), rows16)]
    assert c.metrics.mean_nll_base == pytest.approx(nll[0]) and c.metrics.mean_nll_new == pytest.approx(nll[1])
    # r5 is ok in the baseline and an error in the candidate: that alone fails the gate by default
    r = run_cli(tmp_path / "a.parquet", tmp_path / "b.parquet")
    assert r.exit_code == 1 and "Excluded records" in r.output and "bad field 'text'" in r.output
    assert "--max-new-errors" in r.output and "FAIL" in r.output
    r = run_cli(tmp_path / "a.parquet", tmp_path / "b.parquet", "--max-new-errors", 1)
    assert r.exit_code == 0, r.output
    r = run_cli(tmp_path / "a.parquet", tmp_path / "b.parquet", "--max-new-errors", 1, "--max-excluded-fraction", 0.25)
    assert r.exit_code == 1 and "--max-excluded-fraction" in r.output  # 3 of 8 excluded


def mc_rows(preds: list[int], preds_norm: list[int], answers: list[int]) -> list[dict]:
    return [{"id": f"q{i}", "status": "ok", "num_tokens": 10, "choice_logprobs": [-1.0, -2.0, -3.0],
             "choice_logprobs_norm": [-0.5, -0.6, -0.7], "pred": p, "pred_norm": pn, "correct": p == a,
             "correct_norm": pn == a, "answer": a} for i, (p, pn, a) in enumerate(zip(preds, preds_norm, answers))]


def test_multiple_choice_flips_and_accuracy_gate(tmp_path) -> None:
    answers = [0, 1, 2, 0, 1]
    base = write_results(tmp_path / "a.parquet", mc_rows([0, 1, 2, 1, 1], [0, 1, 2, 0, 1], answers))
    new = write_results(tmp_path / "b.parquet", mc_rows([0, 2, 2, 0, 0], [0, 1, 2, 0, 1], answers))
    c = compare_files(base, new)
    m = c.metrics
    assert (m.num_choice_records, m.accuracy_base, m.accuracy_new) == (5, 0.8, 0.6)
    assert (m.accuracy_norm_base, m.accuracy_norm_new) == (1.0, 1.0)
    assert [(f.id, f.kind, f.pred_base, f.pred_new, f.correct_base, f.correct_new) for f in c.flips] == [
        ("q1", "acc", 1, 2, True, False), ("q3", "acc", 1, 0, False, True), ("q4", "acc", 1, 0, True, False)]
    r = run_cli(base, new, "--max-accuracy-drop", 0.1, "--decision", "point")  # 5 records: judged by the estimate
    assert r.exit_code == 1 and "flipped" in r.output and "q4" in r.output
    assert run_cli(base, new, "--max-accuracy-drop", 0.25, "--decision", "point").exit_code == 0
    # by its bound (the default), a 20-point drop on 5 records is not significantly beyond 10 points
    assert run_cli(base, new, "--max-accuracy-drop", 0.1).exit_code == 0


def test_perplexity_files_without_per_token_columns(tmp_path) -> None:
    def rows(scale: float) -> list[dict]:
        out = []
        for i, (n, words, nbytes) in enumerate([(100, 60, 300), (50, 30, 160)]):
            s = -scale * n * (1 + i)
            out.append({"id": str(i), "status": "ok", "num_tokens": n + 1, "num_words": words, "num_bytes": nbytes,
                        "sum_logprob": s, "perplexity": math.exp(-s / n)})
        return out

    kw = {"command": "perplexity", "schema": PERPLEXITY_SCHEMA}
    base = write_results(tmp_path / "a.parquet", rows(2.0), **kw)
    new = write_results(tmp_path / "b.parquet", rows(2.2), **kw)
    c = compare_files(base, new)
    nll_b, nll_n = 2.0 * 200 / 150, 2.2 * 200 / 150
    assert c.metrics.ppl_ratio == pytest.approx(math.exp(nll_n - nll_b))
    assert c.metrics.word_ppl_base == pytest.approx(math.exp(2.0 * 200 / 90))
    assert c.metrics.bits_per_byte_new == pytest.approx(2.2 * 200 / 460 / math.log(2))
    assert run_cli(base, new, "--max-ppl-ratio", 1.5).exit_code == 0
    assert run_cli(base, new, "--max-ppl-ratio", 1.2).exit_code == 1
    r = run_cli(base, new, "--max-abs-logprob-diff", 1)
    assert r.exit_code == 2 and "needs token_logprobs" in one_line(r.stderr)
    # A score file is not a perplexity file.
    score = write_results(tmp_path / "c.parquet", [{"id": "0", "status": "ok"}, {"id": "1", "status": "ok"}])
    assert "same command" in one_line(run_cli(base, score).stderr)
    # Other windows measure another perplexity (a longer window conditions on more): refused, not gated.
    window = {"window": 64, "stride": 64, "prefix_token_id": 1, "prompt_logprobs": None}
    base = write_results(tmp_path / "w64.parquet", rows(2.0), job=window, **kw)
    same = write_results(tmp_path / "w64b.parquet", rows(2.2), job=dict(window, prompt_logprobs=2), **kw)
    other = write_results(tmp_path / "w32.parquet", rows(2.0), job=dict(window, window=32, stride=32), **kw)
    assert run_cli(base, same, "--max-ppl-ratio", 1.5).exit_code == 0
    r = run_cli(base, other, "--max-ppl-ratio", 1.5)
    assert r.exit_code == 2 and ("other windows (baseline --window 64 --stride 64, candidate --window 32 "
                                 "--stride 32)") in one_line(r.stderr), r.stderr


def test_thresholds_from_toml(fp32_bf16, tmp_path) -> None:
    example = load_thresholds(REPO / "configs" / "compare.toml")
    assert example.max_mean_kld is not None and example.min_top1_agreement is not None
    cfg = tmp_path / "gate.toml"
    cfg.write_text("[thresholds]\nmax_mean_kld = 0.0\nmax_ppl_ratio = 2\n")
    assert load_thresholds(cfg) == Thresholds(max_ppl_ratio=2.0, max_mean_kld=0.0)
    base, new = fp32_bf16[:2]
    assert run_cli(base, new, "--config", cfg).exit_code == 1
    assert run_cli(base, new, "--config", cfg, "--max-mean-kld", 1).exit_code == 0  # the option wins
    cfg.write_text("[thresholds]\nmax_kld = 0.1\n")
    r = run_cli(base, new, "--config", cfg)
    assert r.exit_code == 2 and "unknown threshold 'max_kld'" in one_line(r.stderr)
    cfg.write_text("[thresholds\n")
    with pytest.raises(ApcscoreError, match="not valid TOML"):
        load_thresholds(cfg)
    # issue 46, item 11: max_new_errors = 1.5 was taken, where --max-new-errors 1.5 is refused (a count)
    for value in ("1.5", "2.0"):
        cfg.write_text(f"# the gate\n[thresholds]\nmax_new_errors = {value}\n")
        with pytest.raises(ApcscoreError, match=rf"gate.toml:3: \[thresholds\] max_new_errors must be a whole "
                                                rf"number, not {value}"):
            load_thresholds(cfg)
    cfg.write_text("[thresholds]\nmax_new_errors = 2\n")
    assert load_thresholds(cfg).max_new_errors == 2


# ---------------------------------------------------------------------------------------------------------
# End to end: `apcscore score` in float32 and bfloat16 on a tiny random Llama, then `apcscore compare`
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_end_to_end_score_fp32_vs_bf16(tiny_model_dir, write_jsonl, tmp_path) -> None:
    from apcscore.cli import app  # the real app, where `compare` is registered next to `score`

    data = write_jsonl(tmp_path / "data.jsonl", [
        {"id": "capital", "prompt": "The capital of France is Paris. The capital of Germany is Berlin."},
        {"id": "code", "prompt": "def add(a, b):\n    return a + b\n"},
        {"id": "count", "prompt": "One, two, three, four, five, six, seven, eight, nine, ten."},
    ])
    runner = CliRunner()
    out = {}
    for dtype in ("float32", "bfloat16"):
        out[dtype] = tmp_path / f"{dtype}.parquet"
        r = runner.invoke(app, ["score", str(data), "--model", str(tiny_model_dir("llama")), "--device", "cpu",
                                "--dtype", dtype, "--prompt-logprobs", "5", "--out", str(out[dtype]), "--quiet"])
        assert r.exit_code == 0, r.output

    def gate(*args: str | Path):
        return runner.invoke(app, ["compare", *map(str, args)], env={"COLUMNS": "200"})

    r = gate(out["float32"], out["float32"], "--max-mean-kld", 0, "--max-abs-logprob-diff", 0)
    assert r.exit_code == 0, r.output
    js = tmp_path / "report.json"
    r = gate(out["float32"], out["bfloat16"], "--max-mean-kld", 0, "--report-json", js)
    assert r.exit_code == 1, r.output
    report = json.loads(js.read_text())
    assert report["base"]["dtype"] == "float32" and report["new"]["dtype"] == "bfloat16"
    assert report["vocab_size"] == 49152 and not report["vocab_size_inferred"]
    assert report["num_compared"] == 3 and report["metrics"]["num_positions"] > 30
    assert 0 < report["metrics"]["kld"]["mean"] < 1e-2
    assert 0.99 < report["metrics"]["ppl_ratio"] < 1.01
    r = gate(out["float32"], out["bfloat16"], "--max-mean-kld", 1e-2, "--max-ppl-ratio", 1.01)
    assert r.exit_code == 0, r.output


def test_generate_files_are_refused_not_passed_with_nothing_compared(tmp_path) -> None:
    """Two generate files have no prompt logprobs, perplexity or accuracy: compare used to print a table of '-'
    and PASS (exit 0) whatever the completions were; a gate that measures nothing must not pass."""
    schema = pa.schema([("id", pa.string()), ("status", pa.string()), ("error", pa.string()),
                        ("completion", pa.string())])
    base = write_results(tmp_path / "base.parquet", [{"id": "a", "status": "ok", "completion": "x"}],
                         command="generate", schema=schema)
    new = write_results(tmp_path / "new.parquet", [{"id": "a", "status": "ok", "completion": "y"}],
                        command="generate", schema=schema)
    res = run_cli(base, new)
    assert res.exit_code == 2, res.output
    assert "was written by `apcscore generate`" in one_line(res.output), res.output
    with pytest.raises(ApcscoreError, match="compare gates"):
        compare_files(base, new)
    # issue 46, item 14: "a eval file"
    ev = write_results(tmp_path / "ev.parquet", [{"id": "a", "status": "ok", "completion": "x"}], command="eval",
                       schema=schema)
    assert "and an eval file has none of them" in one_line(run_cli(ev, ev).output)


def test_counts_and_articles_read_as_english() -> None:
    """Issue 46, item 14: messages said "1 rows" and "a eval"."""
    from apcscore.errors import a, count

    assert (count(1, "row"), count(0, "row"), count(2500, "shard")) == ("1 row", "0 rows", "2,500 shards")
    assert (a("eval"), a("score"), a("generate"), a("Ollama")) == ("an eval", "a score", "a generate", "an Ollama")


def test_config_files_with_a_utf8_byte_order_mark_are_read(tmp_path) -> None:
    """Windows editors start a UTF-8 file with a BOM; tomllib refuses it ('Invalid statement at line 1, column 1',
    with nothing visible there). Datasets skip it; so do --config files, the run commands' and compare's."""
    from apcscore.options.resolve import read_config

    cfg = tmp_path / "c.toml"
    cfg.write_bytes(b"\xef\xbb\xbfprompt_logprobs = 2\r\n")
    assert read_config(cfg, "score")["prompt_logprobs"] == 2
    cfg.write_bytes(b"\xef\xbb\xbf[thresholds]\nmax_ppl_ratio = 1.5\n")
    assert load_thresholds(cfg).max_ppl_ratio == 1.5
