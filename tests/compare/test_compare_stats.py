"""`apcscore compare`'s paired statistics and llama.cpp's divergence block, each checked against scipy (or an
independent numpy computation) and McNemar's exact test against a published worked example.

The real-model test scores 200 generated multiple-choice questions with the default model (SmolLM2-135M) in
float32 and bfloat16 through the CLI and checks McNemar's p and the bootstrap interval against scipy.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from scipy import stats as sps
from test_compare import TinyLM, make_records, mc_rows, one_line, run_cli, score_rows, write_results

from apcscore.compare import stats
from apcscore.compare.gate import compare_files
from apcscore.compare.thresholds import Thresholds, load_thresholds
from apcscore.compare.stats import bootstrap_replicates, mcnemar_exact_p, mcnemar_mde, paired_interval
from apcscore.errors import ApcscoreError

# ---------------------------------------------------------------------------------------------------------
# McNemar
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lost,gained", [(0, 0), (1, 0), (0, 1), (3, 3), (5, 0), (10, 2), (2, 10), (7, 8),
                                         (40, 25), (300, 241), (2500, 2400), (0, 60)])
def test_mcnemar_p_is_scipys_exact_binomial_test(lost: int, gained: int) -> None:
    expected = 1.0 if lost + gained == 0 else sps.binomtest(lost, lost + gained, 0.5).pvalue
    assert mcnemar_exact_p(lost, gained) == pytest.approx(expected, rel=1e-9, abs=1e-300)


def test_mcnemar_on_a_published_worked_example() -> None:
    """Fagerland, Lydersen & Laake, "The McNemar test for binary matched-pairs data: mid-p and asymptotic are
    better than exact conditional", BMC Medical Research Methodology 13:91 (2013), Table 2: airway
    hyper-responsiveness before and after stem cell transplantation in 21 children, discordant pairs 1 and 7;
    the exact conditional test gives p = 0.070 (and the asymptotic McNemar test p = 0.034)."""
    assert round(mcnemar_exact_p(1, 7), 3) == 0.070
    assert mcnemar_exact_p(1, 7) == 18 / 256  # 2 (C(8,0) + C(8,1)) / 2^8
    assert round(sps.chi2.sf((1 - 7) ** 2 / 8, 1), 3) == 0.034  # the paper's asymptotic figure, same table


@pytest.mark.parametrize("n,discordant,alpha", [(200, 20, 0.05), (1000, 37, 0.05), (60, 5, 0.05),
                                                (5000, 400, 0.01), (200, 200, 0.1)])
def test_mcnemar_mde_has_the_stated_power(n: int, discordant: int, alpha: float) -> None:
    """At the MDE, the normal-approximation power of McNemar's test (Connor 1987) is 0.8, computed with scipy."""
    d, psi = mcnemar_mde(n, discordant, alpha), discordant / n
    power = sps.norm.cdf((d * math.sqrt(n) - sps.norm.ppf(1 - alpha / 2) * math.sqrt(psi)) / math.sqrt(psi - d * d))
    assert power == pytest.approx(0.8, abs=1e-9)
    assert mcnemar_mde(n, 0, alpha) is None


# ---------------------------------------------------------------------------------------------------------
# The paired bootstrap
# ---------------------------------------------------------------------------------------------------------


def _ratio(num, den, axis=-1):
    return num.sum(axis=axis) / den.sum(axis=axis)


@pytest.mark.parametrize("chunk", [1 << 22, 1000])  # one draw, and draws split into chunks of rows
def test_bootstrap_interval_is_scipys_paired_percentile_bootstrap(monkeypatch, chunk: int) -> None:
    monkeypatch.setattr(stats, "_CHUNK", chunk)
    rng = np.random.default_rng(3)
    den = rng.integers(1, 40, 150).astype(np.float64)  # tokens per record
    num = rng.normal(0.01, 0.05, 150) * den  # per-record sum of nll deltas
    iv = paired_interval("ln PPL ratio", num, den, "positive", 0.05, 999, 7)
    ref = sps.bootstrap((num, den), _ratio, paired=True, vectorized=True, n_resamples=999, method="percentile",
                        confidence_level=0.95, rng=np.random.default_rng(7))
    assert (iv.low, iv.high) == pytest.approx((ref.confidence_interval.low, ref.confidence_interval.high),
                                              rel=1e-12)
    assert iv.se == pytest.approx(ref.standard_error, rel=1e-12)
    z = sps.norm.ppf(0.975) + sps.norm.ppf(0.8)
    assert iv.mde == pytest.approx(z * ref.standard_error, rel=1e-12)
    assert iv.estimate == pytest.approx(num.sum() / den.sum(), rel=1e-15)
    # an independent computation: the same resamples drawn and averaged in plain numpy
    idx = np.random.default_rng(7).integers(0, 150, (999, 150))
    reps = num[idx].sum(1) / den[idx].sum(1)
    assert np.allclose(bootstrap_replicates(num, den, 999, 7), reps, rtol=1e-13, atol=0)
    # seeded: the same seed gives the same interval, another seed another
    again = paired_interval("ln PPL ratio", num, den, "positive", 0.05, 999, 7)
    other = paired_interval("ln PPL ratio", num, den, "positive", 0.05, 999, 8)
    assert (again.low, again.high) == (iv.low, iv.high) and (other.low, other.high) != (iv.low, iv.high)


# ---------------------------------------------------------------------------------------------------------
# The gate: --significance on result files
# ---------------------------------------------------------------------------------------------------------


def _mc_pair(tmp_path: Path, lost: int, gained: int, same: int = 50) -> tuple[Path, Path]:
    """Result files of `same + lost + gained` questions (answer 0): `lost` right only in the baseline, `gained`
    right only in the candidate, the others right in both."""
    pb = [0] * same + [0] * lost + [1] * gained
    pn = [0] * same + [1] * lost + [0] * gained
    answers = [0] * len(pb)
    return (write_results(tmp_path / "a.parquet", mc_rows(pb, pb, answers)),
            write_results(tmp_path / "b.parquet", mc_rows(pn, pn, answers)))


def test_a_significant_drop_is_reported_not_failed_by_itself(tmp_path) -> None:
    """10 lost, 1 gained of 61: McNemar p = 0.0117, reported; with no accuracy tolerance given, the default limit
    (2 points) is judged by the drop's bound, and `--significance` only sets the level of the bounds."""
    base, new = _mc_pair(tmp_path, lost=10, gained=1)
    c = compare_files(base, new, Thresholds(significance=0.05), samples=500, seed=1)
    acc = c.stats.mcnemar[0]
    assert (acc.kind, acc.num_records, acc.lost, acc.gained) == ("acc", 61, 10, 1)
    assert acc.p_value == pytest.approx(sps.binomtest(10, 11, 0.5).pvalue, rel=1e-12)  # 0.0117
    assert [ch.option for ch in c.checks] == ["--max-new-errors", "--max-broken"]  # no tolerance, no verdict on it
    # the accuracy interval is the bootstrap of the per-record deltas, checked against scipy
    delta = np.array([0.0] * 50 + [-1.0] * 10 + [1.0] * 1)
    ref = sps.bootstrap((delta,), np.mean, n_resamples=500, method="percentile", rng=np.random.default_rng(1))
    iv = next(i for i in c.stats.intervals if i.figure == "accuracy")
    assert (iv.low, iv.high) == pytest.approx(tuple(ref.confidence_interval), rel=1e-12)
    r = run_cli(base, new, "--significance", 0.05, "--seed", 1, "--no-default-gate")
    assert r.exit_code == 0 and "10 lost" not in r.output, r.output  # moved significantly: not a failure alone
    r = run_cli(base, new, "--significance", 0.05, "--seed", 1)  # the default 2-point limit: beyond it
    assert r.exit_code == 1 and "--max-accuracy-drop" in r.output, r.output
    # the same change the other way is an improvement: it passes
    assert run_cli(new, base, "--significance", 0.05).exit_code == 0
    # from the config file
    cfg = tmp_path / "gate.toml"
    cfg.write_text("[thresholds]\nsignificance = 0.05\n")
    assert load_thresholds(cfg) == Thresholds(significance=0.05)
    assert run_cli(base, new, "--config", cfg).exit_code == 1


def test_significance_needs_figures_and_a_level_in_range(tmp_path) -> None:
    base = write_results(tmp_path / "a.parquet", [{"id": "0", "status": "ok"}, {"id": "1", "status": "ok"}])
    r = run_cli(base, base, "--significance", 0.05)  # nothing to bound: the level alone checks nothing
    assert r.exit_code == 0, r.output
    for bad in ("0", "0.7", "nan"):
        r = run_cli(base, base, "--significance", bad)
        assert r.exit_code == 2 and "--significance must be" in one_line(r.stderr), (bad, r.stderr)
    with pytest.raises(ApcscoreError, match="significance must be"):
        Thresholds(significance=1.0)


def test_a_small_sample_is_said_to_be_too_small(tmp_path) -> None:
    base, new = _mc_pair(tmp_path, lost=5, gained=0, same=55)
    c = compare_files(base, new)
    assert c.stats.mcnemar[0].p_value == 0.0625 and c.stats.mcnemar[0].mde > 5 / 60
    assert any("too small to decide" in n for n in c.notes)
    big_base, big_new = _mc_pair(tmp_path, lost=40, gained=10, same=950)
    assert not any("too small" in n for n in compare_files(big_base, big_new).notes)


# ---------------------------------------------------------------------------------------------------------
# Per-token files: the NLL bootstrap and llama.cpp's divergence block, against independent computations
# ---------------------------------------------------------------------------------------------------------


def test_nll_bootstrap_and_divergence_block_against_numpy_and_scipy(tmp_path) -> None:
    model, records = TinyLM(), make_records(n=12, seed=4)
    rows32, rows16 = (score_rows(model, records, dt, 5) for dt in (torch.float32, torch.bfloat16))
    base = write_results(tmp_path / "a.parquet", rows32)
    new = write_results(tmp_path / "b.parquet", rows16, dtype="bfloat16")
    c = compare_files(base, new, Thresholds(significance=0.1), samples=800, seed=5)
    lp_b = [np.array(r["token_logprobs"][1:]) for r in rows32]
    lp_n = [np.array(r["token_logprobs"][1:]) for r in rows16]
    num = np.array([(b - n).sum() for b, n in zip(lp_b, lp_n)])
    den = np.array([len(b) for b in lp_b], dtype=np.float64)
    ref = sps.bootstrap((num, den), _ratio, paired=True, vectorized=True, n_resamples=800, method="percentile",
                        confidence_level=0.9, rng=np.random.default_rng(5))
    iv = c.stats.intervals[0]
    assert iv.figure == "ln PPL ratio" and iv.num_records == 12
    assert (iv.low, iv.high) == pytest.approx(tuple(ref.confidence_interval), rel=1e-9)
    assert iv.estimate == pytest.approx(c.metrics.mean_ln_ppl_ratio, rel=1e-12)
    assert iv.lower == pytest.approx(np.quantile(stats.bootstrap_replicates(num, den, 800, 5), 0.1), rel=1e-12)
    # llama.cpp's block, recomputed from the rows
    b, n = np.concatenate(lp_b), np.concatenate(lp_n)
    dp = np.exp(n) - np.exp(b)
    d = c.metrics.delta_p
    pcts = (99.9, 99, 95, 90, 75, 50, 25, 10, 5, 1, 0.1)
    assert list(d.percentiles.values()) == pytest.approx(list(np.percentile(dp, pcts)), rel=1e-12, abs=1e-15)
    assert (d.max, d.min, d.mean) == pytest.approx((dp.max(), dp.min(), dp.mean()), rel=1e-12, abs=1e-15)
    assert d.mean_se == pytest.approx(sps.sem(dp), rel=1e-9)
    assert d.rms == pytest.approx(math.sqrt((dp ** 2).mean()), rel=1e-12)
    assert d.rms_se == pytest.approx(sps.sem(dp ** 2) / (2 * d.rms), rel=1e-9)  # the delta method
    k = c.metrics.kld
    kl = c.aligned.positions.kld
    assert list(k.percentiles) == ["99.9", "99", "95", "90", "50", "10", "5", "1", "0.1"]
    assert list(k.percentiles.values()) == pytest.approx(
        list(np.percentile(kl, [99.9, 99, 95, 90, 50, 10, 5, 1, 0.1])), rel=1e-12, abs=1e-18)
    assert k.min == kl.min() and k.mean_se == pytest.approx(sps.sem(kl), rel=1e-9)
    same = c.metrics.top1_agreement
    assert c.metrics.top1_agreement_se == pytest.approx(math.sqrt(same * (1 - same) / (len(b) - 1)), rel=1e-12)
    assert c.metrics.mean_ln_ppl_ratio_se == pytest.approx(sps.sem(b - n), rel=1e-9)
    js = tmp_path / "r.json"
    r = run_cli(base, new, "--report-json", js, "--report-md", tmp_path / "r.md")
    assert r.exit_code == 0, r.output
    assert "same top p (top-1 agreement)" in r.output and "Delta p of the target token" in r.output
    data = json.loads(js.read_text())
    assert data["stats"]["samples"] == 2000 and data["stats"]["seed"] == 0 and data["stats"]["alpha"] == 0.05
    assert list(data["metrics"]["delta_p"]["percentiles"]) == [f"{p:g}" for p in pcts]
    md = (tmp_path / "r.md").read_text()
    assert "### Paired bootstrap over records (candidate - baseline; 2000 resamples, seed 0)" in md
    assert "| ln PPL ratio | 12 |" in md


# ---------------------------------------------------------------------------------------------------------
# The real model: 200 multiple-choice questions, float32 against bfloat16
# ---------------------------------------------------------------------------------------------------------


def arithmetic_questions(n: int = 200, seed: int = 43) -> list[dict]:
    """n multiple-choice questions in the format of datasets/sample_choices.jsonl: two-digit +, - and *, the
    answer among three near misses (hard for a 135M model, so its choices are close and bfloat16 flips some)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b, op = rng.randint(10, 99), rng.randint(10, 99), "+-*"[i % 3]
        v = a + b if op == "+" else a - b if op == "-" else a * b
        wrong: set[int] = set()
        while len(wrong) < 3:
            wrong.add(v + rng.choice((-1, 1)) * rng.randint(1, 12))
        choices = [str(x) for x in sorted(wrong)] + [str(v)]
        rng.shuffle(choices)
        out.append({"id": f"q{i:03d}", "context": f"Question: What is {a} {op} {b}?\nAnswer: ", "choices": choices,
                    "answer": choices.index(str(v))})
    return out


@pytest.mark.slow
def test_fp32_vs_bf16_on_200_questions_with_the_default_model(write_jsonl, tmp_path) -> None:
    from typer.testing import CliRunner

    from apcscore.cli import app

    data = write_jsonl(tmp_path / "mc200.jsonl", arithmetic_questions())
    out = {}
    for dtype in ("float32", "bfloat16"):
        out[dtype] = tmp_path / f"{dtype}.parquet"
        r = CliRunner().invoke(app, ["score", str(data), "--device", "cpu", "--dtype", dtype, "--out",
                                     str(out[dtype]), "--quiet"])
        assert r.exit_code == 0, r.output
    js = tmp_path / "compare.json"
    r = CliRunner().invoke(app, ["compare", str(out["float32"]), str(out["bfloat16"]), "--significance", "0.05",
                                 "--report-json", str(js), "--worst", "0"], env={"COLUMNS": "200"})
    assert r.exit_code in (0, 1), r.output
    report = json.loads(js.read_text())
    assert report["base"]["dtype"] == "float32" and report["new"]["dtype"] == "bfloat16"
    # independent: read the correctness columns back with pyarrow and test with scipy
    cb = np.array(pq.read_table(out["float32"], columns=["correct"])["correct"].to_pylist())
    cn = np.array(pq.read_table(out["bfloat16"], columns=["correct"])["correct"].to_pylist())
    lost, gained = int((cb & ~cn).sum()), int((~cb & cn).sum())
    acc = next(t for t in report["stats"]["mcnemar"] if t["kind"] == "acc")
    assert (acc["num_records"], acc["lost"], acc["gained"]) == (200, lost, gained)
    p = sps.binomtest(lost, lost + gained, 0.5).pvalue if lost + gained else 1.0
    assert acc["p_value"] == pytest.approx(p, rel=1e-12)
    iv = next(i for i in report["stats"]["intervals"] if i["figure"] == "accuracy")
    ref = sps.bootstrap(((cn.astype(float) - cb),), np.mean, n_resamples=2000, method="percentile",
                        rng=np.random.default_rng(0))
    assert (iv["low"], iv["high"]) == pytest.approx(tuple(ref.confidence_interval), rel=1e-12, abs=1e-15)
    assert iv["se"] == pytest.approx(ref.standard_error, rel=1e-12, abs=1e-15)
    assert iv["estimate"] == pytest.approx(cn.mean() - cb.mean(), abs=1e-15)
    print(f"\n200 questions, float32 -> bfloat16: accuracy {cb.mean():.3f} -> {cn.mean():.3f}, {lost} lost, "
          f"{gained} gained, McNemar p {acc['p_value']:.4g}, 95% interval [{iv['low']:+.4f}, {iv['high']:+.4f}], "
          f"MDE {acc['mde']}")


@pytest.mark.slow
def test_nll_bootstrap_and_divergence_block_on_the_default_model(tmp_path) -> None:
    """float32 against bfloat16 on datasets/sample_prompts.jsonl: the bootstrap of ln(PPL ratio), delta p and the
    KL block recomputed from the files' columns with pyarrow, numpy and scipy."""
    from typer.testing import CliRunner

    from apcscore.cli import app

    data = Path(__file__).resolve().parents[2] / "datasets" / "sample_prompts.jsonl"
    out = {}
    for dtype in ("float32", "bfloat16"):
        out[dtype] = tmp_path / f"{dtype}.parquet"
        r = CliRunner().invoke(app, ["score", str(data), "--device", "cpu", "--dtype", dtype, "--prompt-logprobs",
                                     "5", "--out", str(out[dtype]), "--quiet"])
        assert r.exit_code == 0, r.output
    c = compare_files(out["float32"], out["bfloat16"], Thresholds(significance=0.05))
    tb, tn = (pq.read_table(out[d], columns=["id", "token_logprobs"]).to_pylist() for d in ("float32", "bfloat16"))
    assert [r["id"] for r in tb] == [r["id"] for r in tn]
    lp_b = [np.array(r["token_logprobs"][1:], dtype=np.float64) for r in tb]
    lp_n = [np.array(r["token_logprobs"][1:], dtype=np.float64) for r in tn]
    num = np.array([(b - n).sum() for b, n in zip(lp_b, lp_n)])
    den = np.array([len(b) for b in lp_b], dtype=np.float64)
    ref = sps.bootstrap((num, den), _ratio, paired=True, vectorized=True, n_resamples=2000, method="percentile",
                        rng=np.random.default_rng(0))
    iv = c.stats.intervals[0]
    assert (iv.figure, iv.num_records) == ("ln PPL ratio", len(tb))
    assert (iv.low, iv.high) == pytest.approx(tuple(ref.confidence_interval), rel=1e-9)
    assert iv.se == pytest.approx(ref.standard_error, rel=1e-9)
    b, n = np.concatenate(lp_b), np.concatenate(lp_n)
    dp = np.exp(n) - np.exp(b)
    d = c.metrics.delta_p
    assert list(d.percentiles.values()) == pytest.approx(
        list(np.percentile(dp, (99.9, 99, 95, 90, 75, 50, 25, 10, 5, 1, 0.1))), rel=1e-9, abs=1e-12)
    assert (d.min, d.max, d.mean_se) == pytest.approx((dp.min(), dp.max(), sps.sem(dp)), rel=1e-9, abs=1e-12)
    assert c.metrics.mean_ln_ppl_ratio_se == pytest.approx(sps.sem(b - n), rel=1e-9)
    kl = c.aligned.positions.kld
    k = c.metrics.kld
    assert list(k.percentiles.values()) == pytest.approx(
        list(np.percentile(kl, (99.9, 99, 95, 90, 50, 10, 5, 1, 0.1))), rel=1e-9, abs=1e-15)
    assert (k.min, k.mean_se) == pytest.approx((kl.min(), sps.sem(kl)), rel=1e-9, abs=1e-15)
    assert 0 < k.mean < 1e-2 and 0.9 < c.metrics.top1_agreement <= 1
