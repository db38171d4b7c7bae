"""The regression gate's verdicts: the default limits on a candidate set built here (harmless changes pass, damage
fails), the margin tests against scipy's one-sided bootstrap, the decision modes, where each limit came from, and
broken numbers (NaN, +-inf, a value on one side only) that never pass.

The tiny candidates are a `TinyLM` (tests/compare/test_compare.py) changed the ways real models are changed: another
dtype, a bf16 round trip of the weights, weight noise, a zeroed projection. The default model's own candidate set is
`scripts/compare_evidence.py` (docs/compare.md); one slow test runs three of its candidates.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats as sps
from test_compare import TinyLM, make_records, one_line, run_cli, score_rows, write_results
from test_compare_stats import _mc_pair

from apcscore.compare.gate import compare_files
from apcscore.compare.thresholds import DEFAULT_GATE, Thresholds, load_thresholds
from apcscore.compare.stats import clopper_pearson, margin_verdict

ROOT = Path(__file__).resolve().parents[2]


def _noise(rel: float, seed: int = 7):
    def change(m: TinyLM) -> None:
        g = torch.Generator().manual_seed(seed)
        for name in ("emb", "w", "out"):
            t = getattr(m, name)
            setattr(m, name, t + rel * t.std() * torch.randn(t.shape, generator=g))
    return change


def _bf16_weights(m: TinyLM) -> None:
    for name in ("emb", "w", "out"):
        setattr(m, name, getattr(m, name).bfloat16().float())


def _zero_w(m: TinyLM) -> None:
    m.w = torch.zeros_like(m.w)


# name -> (change of the weights or None, dtype the candidate runs in, the verdict a user expects)
CANDIDATES = {
    "exact copy": (None, torch.float32, "pass"),
    "bf16 compute": (None, torch.bfloat16, "pass"),
    "bf16 round trip of the weights": (_bf16_weights, torch.float32, "pass"),
    "1% weight noise": (_noise(0.01), torch.float32, "pass"),
    "30% weight noise": (_noise(0.3), torch.float32, "fail"),
    # perplexity *falls* (the zeroed model is nearly uniform, which this random model's targets favour): only the
    # distance figures see the damage
    "zeroed projection": (_zero_w, torch.float32, "fail"),
}


@pytest.fixture(scope="module")
def candidates(tmp_path_factory) -> dict[str, Path]:
    """Result files (K = 5) of 40 records: the baseline (float32, unchanged) and every candidate."""
    tmp = tmp_path_factory.mktemp("gate")
    model, records = TinyLM(), make_records(n=40, seed=3)
    out = {"baseline": write_results(tmp / "baseline.parquet", score_rows(model, records, torch.float32, 5))}
    for i, (name, (change, dtype, _)) in enumerate(CANDIDATES.items()):
        m = copy.deepcopy(model)
        if change is not None:
            change(m)
        out[name] = write_results(tmp / f"c{i}.parquet", score_rows(m, records, dtype, 5),
                                  dtype="bfloat16" if dtype == torch.bfloat16 else "float32")
    return out


@pytest.mark.parametrize("name", list(CANDIDATES))
def test_the_default_gate_passes_harmless_changes_and_fails_damage(candidates, name, tmp_path) -> None:
    expected = CANDIDATES[name][2]
    js = tmp_path / "r.json"
    r = run_cli(candidates["baseline"], candidates[name], "--report-json", js)
    assert r.exit_code == (0 if expected == "pass" else 1), r.output
    checks = json.loads(js.read_text())["checks"]
    applied = {ch["option"]: ch for ch in checks}
    # no option given: every default limit the files can give is applied, each saying so
    for key in ("max_ppl_ratio", "max_mean_kld", "min_top1_agreement"):
        ch = applied["--" + key.replace("_", "-")]
        assert ch["source"] == "default" and ch["threshold"] == DEFAULT_GATE[key]
        assert ch["bound"].startswith(("lower 95% bound", "upper 95% bound")), ch
    assert applied["--max-broken"]["source"] == "default" and applied["--max-new-errors"]["source"] == "default"
    if expected == "fail":  # a distance catches it, whatever the perplexity did
        assert not applied["--max-mean-kld"]["passed"] and not applied["--min-top1-agreement"]["passed"]
    assert "default" in r.output  # the terminal's table names where each limit came from


def test_damage_passes_only_with_the_defaults_turned_off(candidates) -> None:
    r = run_cli(candidates["baseline"], candidates["zeroed projection"], "--no-default-gate")
    assert r.exit_code == 0, r.output  # what the gate did before: only new errors and broken numbers checked
    c = compare_files(candidates["baseline"], candidates["zeroed projection"], Thresholds())
    assert {ch.option for ch in c.checks} == {"--max-new-errors", "--max-broken"}
    assert c.metrics.ppl_ratio < 1 < c.metrics.kld.mean * 10  # PPL improved; KL says the model is another one


def test_a_significant_but_harmless_change_never_fails(candidates) -> None:
    """1% weight noise changes the model significantly (top-1 agreement's whole bootstrap interval below 100%, KL's
    above 0) but by far less than the tolerances: at any level, it passes. 'The figure moved significantly' alone
    is never a failure."""
    c = compare_files(candidates["baseline"], candidates["1% weight noise"], Thresholds.defaults())
    intervals = {i.figure: i for i in c.stats.intervals}
    assert intervals["top-1 agreement"].high < 1 and intervals["mean KL"].low > 0, "no significant change here"
    for alpha in ("0.05", "0.2", "0.5"):
        r = run_cli(candidates["baseline"], candidates["1% weight noise"], "--significance", alpha)
        assert r.exit_code == 0, r.output


# ---------------------------------------------------------------------------------------------------------
# The margin tests: one-sided bootstrap bounds against scipy, and the three decisions
# ---------------------------------------------------------------------------------------------------------


def _ratio(num, den, axis=-1):
    return num.sum(axis=axis) / den.sum(axis=axis)


def _scipy_bounds(num: np.ndarray, den: np.ndarray, alpha: float, samples: int, seed: int) -> tuple[float, float]:
    """(alpha quantile, 1 - alpha quantile) of the paired percentile bootstrap of sum(num) / sum(den), by scipy's
    one-sided intervals on the same resamples."""
    kw = dict(paired=True, vectorized=True, n_resamples=samples, method="percentile", confidence_level=1 - alpha)
    low = sps.bootstrap((num, den), _ratio, alternative="greater", rng=np.random.default_rng(seed), **kw)
    high = sps.bootstrap((num, den), _ratio, alternative="less", rng=np.random.default_rng(seed), **kw)
    return low.confidence_interval.low, high.confidence_interval.high


@pytest.mark.parametrize("alpha", [0.05, 0.1])
def test_one_sided_bounds_are_scipys(candidates, alpha) -> None:
    c = compare_files(candidates["baseline"], candidates["30% weight noise"], Thresholds(significance=alpha),
                      samples=700, seed=3)
    pos = c.aligned.positions
    r = c.num_compared
    per_figure = {
        "ln PPL ratio": (np.bincount(pos.record, pos.base_lp - pos.new_lp, r), np.bincount(pos.record, None, r)),
        "mean KL": (np.bincount(pos.record, pos.kld, r), np.bincount(pos.record, None, r)),
        "top-1 agreement": (np.bincount(pos.record, pos.top1.astype(float), r), np.bincount(pos.record, None, r)),
    }
    intervals = {iv.figure: iv for iv in c.stats.intervals}
    for figure, (num, den) in per_figure.items():
        iv = intervals[figure]
        assert (iv.lower, iv.upper) == pytest.approx(_scipy_bounds(num, den.astype(float), alpha, 700, 3), rel=1e-9)
        assert iv.estimate == pytest.approx(num.sum() / den.sum(), rel=1e-12)
    # each check reads its own figure's bound: the optimistic one (non-inferiority)
    by = {ch.option: ch for ch in c.checks}
    assert by.get("--max-mean-kld") is None  # no limit given
    c = compare_files(candidates["baseline"], candidates["30% weight noise"],
                      Thresholds(max_ppl_ratio=1.0, max_mean_kld=1.0, min_top1_agreement=0.0, significance=alpha),
                      samples=700, seed=3)
    by = {ch.option: ch for ch in c.checks}
    conf = f"{100 * (1 - alpha):g}%"
    assert by["--max-ppl-ratio"].bound == f"lower {conf} bound {math.exp(intervals['ln PPL ratio'].lower):.6g}"
    assert by["--max-mean-kld"].bound == f"lower {conf} bound {intervals['mean KL'].lower:.6g}"
    assert by["--min-top1-agreement"].bound == f"upper {conf} bound {intervals['top-1 agreement'].upper:.6g}"


def test_the_accuracy_drop_is_judged_by_its_exact_bound(tmp_path) -> None:
    """Multiple choice: 10 lost, 1 gained of 61 (a 14.8-point drop, McNemar p = 0.012). Given the 11 flips,
    lost ~ Binomial(11, q) and the drop is 11 (2 q - 1) / 61: its one-sided bounds are scipy's exact
    (Clopper-Pearson) bounds of q, mapped."""
    base, new = _mc_pair(tmp_path, lost=10, gained=1)
    c = compare_files(base, new, Thresholds(max_accuracy_drop=0.1))
    ci = sps.binomtest(10, 11).proportion_ci(confidence_level=0.9, method="exact")  # one-sided 95% ends
    low, high = 11 * (2 * ci.low - 1) / 61, 11 * (2 * ci.high - 1) / 61
    mc = c.stats.mcnemar[0]
    assert (mc.drop_lower, mc.drop_upper) == pytest.approx((low, high), rel=1e-9)
    acc = next(ch for ch in c.checks if ch.metric.startswith("accuracy drop"))
    assert acc.value == pytest.approx(9 / 61) and acc.bound == f"lower 95% bound {low:.6g}"
    assert acc.passed == (low <= 0.1)
    assert mc.p_value == pytest.approx(sps.binomtest(10, 11, 0.5).pvalue, rel=1e-12)
    # a tolerance below the whole interval fails by default; a tolerance above the estimate passes by default,
    # and in strict mode only when the pessimistic bound is within it too
    assert high > 0.16 > 9 / 61 > low > 0.01
    assert run_cli(base, new, "--max-accuracy-drop", 0.01).exit_code == 1
    assert run_cli(base, new, "--max-accuracy-drop", 0.16).exit_code == 0
    assert run_cli(base, new, "--max-accuracy-drop", 0.16, "--decision", "strict").exit_code == 1
    assert run_cli(base, new, "--max-accuracy-drop", 0.16, "--decision", "point").exit_code == 0
    # the same change the other way is an improvement: it passes
    assert run_cli(new, base, "--max-accuracy-drop", 0.0).exit_code == 0


@pytest.mark.parametrize("k,n,alpha", [(0, 5, 0.05), (5, 5, 0.05), (3, 40, 0.1), (300, 541, 0.05), (1, 1, 0.2),
                                       (2500, 4900, 0.01)])
def test_clopper_pearson_is_scipys(k, n, alpha) -> None:
    ci = sps.binomtest(k, n).proportion_ci(confidence_level=1 - 2 * alpha, method="exact")
    assert clopper_pearson(k, n, alpha) == pytest.approx((ci.low, ci.high), rel=1e-9, abs=1e-12)


def test_the_three_decisions_between_the_bounds(candidates) -> None:
    """A KL tolerance between the two one-sided bounds: non-inferiority passes (not significantly beyond),
    strict fails (not significantly within); the point decision compares the estimate."""
    base, new = candidates["baseline"], candidates["30% weight noise"]
    iv = next(i for i in compare_files(base, new).stats.intervals if i.figure == "mean KL")
    assert iv.lower < iv.estimate < iv.upper
    between_low, between_high = (iv.lower + iv.estimate) / 2, (iv.estimate + iv.upper) / 2
    verdicts = {}
    for decision in ("margin", "strict", "point"):
        for limit in (between_low, between_high):
            c = compare_files(base, new, Thresholds(max_mean_kld=limit, decision=decision))
            verdicts[decision, limit] = next(ch for ch in c.checks if ch.option == "--max-mean-kld").passed
    assert verdicts["margin", between_low] and verdicts["margin", between_high]
    assert not verdicts["strict", between_low] and not verdicts["strict", between_high]
    assert not verdicts["point", between_low] and verdicts["point", between_high]
    r = run_cli(base, new, "--max-mean-kld", between_high, "--decision", "strict")
    assert r.exit_code == 1 and "upper 95% bound" in one_line(r.output), r.output
    r = run_cli(base, new, "--decision", "maybe")
    assert r.exit_code == 2 and "--decision must be one of margin, strict, point" in one_line(r.stderr)


@pytest.mark.parametrize("op,est,lo,hi,limit,strict,passed", [
    ("<=", 1.0, 0.8, 1.2, 0.9, False, True),  # worsening not significantly beyond 0.9
    ("<=", 1.0, 0.8, 1.2, 0.9, True, False),
    ("<=", 1.0, 0.8, 1.2, 0.7, False, False),  # significantly beyond
    ("<=", 1.0, 0.8, 1.2, 1.3, True, True),  # significantly within
    (">=", 0.9, 0.85, 0.95, 0.93, False, True),
    (">=", 0.9, 0.85, 0.95, 0.93, True, False),
    (">=", 0.9, 0.85, 0.95, 0.96, False, False),
    ("<=", 1.0, None, None, 0.9, False, False),  # no bounds: the estimate
    ("<=", 1.0, math.nan, math.nan, 1.1, True, True),
])
def test_margin_verdict(op, est, lo, hi, limit, strict, passed) -> None:
    assert margin_verdict(est, op, limit, lo, hi, strict)[0] is passed


# ---------------------------------------------------------------------------------------------------------
# Where each limit came from
# ---------------------------------------------------------------------------------------------------------


def test_each_limit_names_its_source(candidates, tmp_path) -> None:
    cfg = tmp_path / "gate.toml"
    cfg.write_text("[thresholds]\nmax_mean_kld = 0.5\nmin_top1_agreement = 0.1\ndecision = \"strict\"\n")
    t = (Thresholds.defaults().override(load_thresholds(cfg))
         .override(Thresholds(min_top1_agreement=0.2).given("option")))
    assert (t.source("max_ppl_ratio"), t.source("max_mean_kld"), t.source("min_top1_agreement")) == \
        ("default", f"config {cfg}", "option")
    assert t.decision == "strict" and t.min_top1_agreement == 0.2 and t.max_mean_kld == 0.5
    js = tmp_path / "r.json"
    r = run_cli(candidates["baseline"], candidates["bf16 compute"], "--config", cfg, "--min-top1-agreement", 0.2,
                "--report-json", js)
    assert r.exit_code == 0, r.output
    sources = {ch["option"]: ch["source"] for ch in json.loads(js.read_text())["checks"]}
    assert sources == {"--max-new-errors": "default", "--max-broken": "default", "--max-ppl-ratio": "default",
                       "--max-mean-kld": f"config {cfg}", "--min-top1-agreement": "option"}
    assert "strict" not in Thresholds.defaults().sources and Thresholds.defaults().decision is None


def test_a_default_limit_the_files_cannot_give_is_skipped_with_a_note(tmp_path) -> None:
    """Files without top-K (score --prompt-logprobs 0) have no KL and no top-1 agreement: the defaults on them are
    left out with a note, while the same limit given as an option is a usage error (exit 2)."""
    model, records = TinyLM(), make_records(n=6)
    drop = ("top_ids", "top_logprobs")
    base = write_results(tmp_path / "a.parquet", score_rows(model, records, torch.float32, 0), drop=drop)
    new = write_results(tmp_path / "b.parquet", score_rows(model, records, torch.bfloat16, 0), drop=drop)
    r = run_cli(base, new)
    assert r.exit_code == 0, r.output
    assert "default --max-mean-kld not applied" in one_line(r.output)
    assert "default --min-top1-agreement not applied" in one_line(r.output)
    assert "default --max-accuracy-drop not applied" in one_line(r.output)
    assert run_cli(base, new, "--max-mean-kld", 0.5).exit_code == 2


# ---------------------------------------------------------------------------------------------------------
# Broken numbers: NaN, +-inf, a value on one side only
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scored(tmp_path_factory) -> tuple[Path, list[dict], list[dict]]:
    tmp = tmp_path_factory.mktemp("broken")
    model, records = TinyLM(), make_records(n=8, seed=2)
    rows = score_rows(model, records, torch.float32, 5)
    return write_results(tmp / "base.parquet", rows), rows, score_rows(model, records, torch.bfloat16, 5)


def _strict_gate() -> list[str]:
    return ["--max-ppl-ratio", "1.001", "--max-mean-kld", "0.001", "--min-top1-agreement", "0.999",
            "--max-abs-logprob-diff", "1e-6"]


def test_nan_at_every_other_position_never_passes(scored, tmp_path) -> None:
    """The review's case: a candidate whose logprobs are NaN at every other scored position (status ok, as a broken
    kernel or an fp16 overflow writes) passed the strictest thresholds, its NaN positions dropped as unscored."""
    base, rows, _ = scored
    bad = copy.deepcopy(rows)
    nan_count = 0
    for r in bad:
        for i in range(1, len(r["token_logprobs"]), 2):
            r["token_logprobs"][i] = math.nan
            nan_count += 1
    new = write_results(tmp_path / "nan.parquet", bad)
    for args in (_strict_gate(), [], ["--no-default-gate"]):
        r = run_cli(base, new, *args)
        assert r.exit_code == 1, (args, r.output)
        text = one_line(r.output)
        assert f"candidate token_logprobs NaN: {nan_count}" in text and f"'{rows[0]['id']}'" in text, text
    c = compare_files(base, new)
    assert c.broken.positions == nan_count and c.broken.records == len(rows)
    assert not next(ch for ch in c.checks if ch.option == "--max-broken").passed
    # the figures hold only the positions both sides scored with numbers
    assert c.metrics.num_positions == sum(len(r["token_logprobs"]) - 1 for r in rows) - nan_count
    assert math.isfinite(c.metrics.ppl_ratio) and c.metrics.ppl_ratio == 1.0
    # allowing them is a choice the user makes in so many words
    assert run_cli(base, new, "--max-broken", nan_count + len(rows)).exit_code == 0


@pytest.mark.parametrize("where,value,kind", [
    ("candidate", math.inf, "candidate token_logprobs infinite"),
    ("candidate", -math.inf, "candidate token_logprobs infinite"),
    ("candidate", None, "candidate token_logprobs null where the other side scored"),
    ("baseline", math.nan, "baseline token_logprobs NaN"),
    ("baseline", None, "baseline token_logprobs null where the other side scored"),
])
def test_one_broken_position_fails_the_gate(scored, tmp_path, where, value, kind) -> None:
    base_path, rows, _ = scored
    b, n = copy.deepcopy(rows), copy.deepcopy(rows)
    (b if where == "baseline" else n)[3]["token_logprobs"][4] = value
    base = write_results(tmp_path / "b.parquet", b) if where == "baseline" else base_path
    new = write_results(tmp_path / "n.parquet", n)
    c = compare_files(base, new, Thresholds.defaults())
    assert c.broken.kinds == {kind: 1} and c.broken.examples == [rows[3]["id"]]
    assert not c.passed and c.broken.positions == 1
    assert run_cli(base, new).exit_code == 1


def test_a_broken_alternative_and_a_broken_summary_fail_too(scored, tmp_path) -> None:
    base, rows, _ = scored
    n = copy.deepcopy(rows)
    n[1]["top_logprobs"][2][1] = math.nan
    c = compare_files(base, write_results(tmp_path / "topk.parquet", n))
    assert c.broken.kinds == {"candidate top_logprobs NaN or +inf": 1} and not c.passed
    n = copy.deepcopy(rows)
    n[5]["sum_logprob"] = math.inf
    c = compare_files(base, write_results(tmp_path / "sum.parquet", n))
    assert c.broken.kinds == {"candidate sum_logprob NaN or infinite": 1} and c.broken.records == 1
    assert not c.passed and c.num_compared == len(rows) - 1


def test_null_on_both_sides_is_not_broken(scored, tmp_path) -> None:
    """Null = not scored by design (e.g. positions a run was not asked to score): the same nulls on both sides are
    simply not compared."""
    _, rows, rows16 = scored
    b, n = copy.deepcopy(rows), copy.deepcopy(rows16)
    for r in (b[2], n[2]):
        r["token_logprobs"][3] = None
        r["top_ids"][3] = r["top_logprobs"][3] = None
    c = compare_files(write_results(tmp_path / "b.parquet", b),
                      write_results(tmp_path / "n.parquet", n, dtype="bfloat16"), Thresholds.defaults())
    assert c.broken.positions == 0 and c.broken.kinds == {} and c.passed


# ---------------------------------------------------------------------------------------------------------
# The default model: three candidates of the evidence set
# ---------------------------------------------------------------------------------------------------------


def _evidence():
    spec = importlib.util.spec_from_file_location("compare_evidence", ROOT / "scripts" / "compare_evidence.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["compare_evidence"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_default_gate_on_the_default_model(tmp_path, write_jsonl) -> None:
    """30 records of the evidence set, scored with the default model: a bf16 round trip of its weights passes the
    default gate, its layer 15's MLP zeroed and 5% weight noise fail it (docs/compare.md has the full table)."""
    from typer.testing import CliRunner

    from apcscore.cli import app
    from apcscore.models.locate import resolve_model

    ev = _evidence()
    records = ev.build_dataset()
    data = write_jsonl(tmp_path / "ev.jsonl", records[::5][:30])
    base_model = resolve_model("smollm2-135m")[0]
    out = {}
    for name in ("baseline", "bf16_weights", "mlp_zeroed", "noise_5pct"):
        model = base_model
        if name != "baseline":
            model = tmp_path / name
            ev.write_folder(base_model, model, ev.CANDIDATES[name][2])
        out[name] = tmp_path / f"{name}.parquet"
        r = CliRunner().invoke(app, ["score", str(data), "--model", str(model), "--prompt-logprobs", "5", "--out",
                                     str(out[name]), "--quiet"])
        assert r.exit_code == 0, r.output
    for name, code in (("bf16_weights", 0), ("mlp_zeroed", 1), ("noise_5pct", 1)):
        r = run_cli(out["baseline"], out[name])
        assert r.exit_code == code, (name, r.output)
