"""`apcscore compare BASE_DIR CAND_DIR`: two `apcscore eval` folders, per task and metric, paired by document.

Real runs: the default model evaluates the local tasks apc_ll (loglikelihood: perplexity, acc) and apc_mc
(multiple choice: acc, acc_norm) of tests/lmeval_tasks through the CLI, in float32 and in bfloat16, with one
few-shot example, and once more with two (a setting that must be refused). Every figure is recomputed here
from the raw responses in requests.parquet (log-likelihoods, greedy flags), not from lm-eval's per-sample metrics.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from apcscore.compare.eval_runs import compare_eval_dirs, read_eval_dir
from apcscore.compare.thresholds import Thresholds
from apcscore.errors import ApcscoreError

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow
TASK_DIR = Path(__file__).resolve().parents[1] / "lmeval_tasks"


@pytest.fixture(scope="module")
def eval_runs(in_repo, tmp_path_factory, default_model_dir) -> dict[str, Path]:
    from apcscore.cli import app

    out = tmp_path_factory.mktemp("evals")
    runs = {}
    for name, dtype, shots in (("f32", "float32", "1"), ("bf16", "bfloat16", "1"), ("shots2", "float32", "2")):
        runs[name] = out / name
        r = CliRunner().invoke(app, ["eval", "--tasks", "apc_ll,apc_mc", "--include-path", str(TASK_DIR),
                                     "--num-fewshot", shots, "--dtype", dtype, "--out", str(runs[name]), "-q"])
        assert r.exit_code == 0, r.output
    return runs


def _compare(*args: object):
    from apcscore.cli import app

    return CliRunner().invoke(app, ["compare", *map(str, args)], env={"COLUMNS": "300"})


def _per_doc(folder: Path) -> dict[tuple[str, str, int], float]:
    """(task, metric, doc) -> value, from the responses alone: apc_mc's argmax of the loglikelihoods (acc) and of
    the loglikelihoods per character of the choice (acc_norm, the choice without lm-eval's " " delimiter);
    apc_ll's greedy flag (acc) and loglikelihood (lm-eval's per-doc value of perplexity)."""
    rows = pq.read_table(folder / "requests.parquet").to_pylist()
    out: dict[tuple[str, str, int], float] = {}
    docs: dict[int, list] = {}
    for r in rows:
        ll, greedy = json.loads(r["response"])[0]
        if r["task"] == "apc_ll":
            out[("apc_ll", "acc", r["doc_id"])] = float(greedy)
            out[("apc_ll", "perplexity", r["doc_id"])] = ll
        else:
            docs.setdefault(r["doc_id"], []).append((ll, json.loads(r["arguments"])[1], int(json.loads(r["target"]))))
    for doc, choices in docs.items():
        lls = [c[0] for c in choices]
        norm = [c[0] / len(c[1][1:]) for c in choices]
        target = choices[0][2]
        out[("apc_mc", "acc", doc)] = float(lls.index(max(lls)) == target)
        out[("apc_mc", "acc_norm", doc)] = float(norm.index(max(norm)) == target)
    return out


def test_per_task_deltas_are_paired_over_the_same_documents(eval_runs) -> None:
    c = compare_eval_dirs(eval_runs["f32"], eval_runs["bf16"])
    base, new = _per_doc(eval_runs["f32"]), _per_doc(eval_runs["bf16"])
    seen = set()
    for m in c.metrics:
        keys = sorted(k for k in base if k[:2] == (m.task, m.metric))
        assert keys and m.num_docs == len(keys) == (5 if m.task == "apc_ll" else 6)
        xb, xn = [base[k] for k in keys], [new[k] for k in keys]
        if m.metric == "perplexity":  # lm-eval's aggregate: exp(-mean loglikelihood)
            assert m.base == pytest.approx(math.exp(-statistics.fmean(xb)), rel=1e-12)
            assert m.new == pytest.approx(math.exp(-statistics.fmean(xn)), rel=1e-12)
            assert not m.binary
        else:
            assert m.base == pytest.approx(statistics.fmean(xb), abs=1e-12)
            assert m.new == pytest.approx(statistics.fmean(xn), abs=1e-12)
            assert m.binary and m.higher_is_better
            assert m.flips_to_wrong == sum(a == 1 and b == 0 for a, b in zip(xb, xn))
            assert m.flips_to_right == sum(a == 0 and b == 1 for a, b in zip(xb, xn))
        d = [b - a for a, b in zip(xb, xn)]
        assert m.mean_doc_delta == pytest.approx(statistics.fmean(d), abs=1e-12)
        assert m.doc_delta_se == pytest.approx(statistics.stdev(d) / math.sqrt(len(d)), abs=1e-12)
        seen.add((m.task, m.metric))
    assert seen == {("apc_ll", "perplexity"), ("apc_ll", "acc"), ("apc_mc", "acc"), ("apc_mc", "acc_norm")}
    # float32 against bfloat16 moves the loglikelihoods: the paired change of apc_ll's is not zero
    ll = next(m for m in c.metrics if m.metric == "perplexity")
    assert ll.mean_doc_delta != 0 and ll.doc_delta_se > 0


def test_the_gate_checks_each_task_and_gives_junit_ready_cases(eval_runs, tmp_path) -> None:
    ok = _compare(eval_runs["f32"], eval_runs["bf16"], "--max-accuracy-drop", "0.5", "--max-ppl-ratio", "1.5",
                  "--report-md", tmp_path / "ok.md")
    assert ok.exit_code == 0, ok.output
    md = (tmp_path / "ok.md").read_text()
    assert "✅ PASS" in md and "| apc_mc | acc_norm |" in md and "apc_ll perplexity ratio" in md
    # a limit no run can meet: acc must rise by 50 points
    report = tmp_path / "fail.json"
    bad = _compare(eval_runs["f32"], eval_runs["bf16"], "--max-accuracy-drop", "-0.5", "--report-json", report)
    assert bad.exit_code == 1, bad.output
    data = json.loads(report.read_text())
    assert {(c["task"], c["metric"]) for c in data["checks"]} == {
        ("apc_ll", "apc_ll acc drop (base - new)"), ("apc_mc", "apc_mc acc drop (base - new)"),
        ("apc_mc", "apc_mc acc_norm drop (base - new)"), ("apc_ll", "apc_ll perplexity ratio (new / base)")}
    assert {c["source"] for c in data["checks"] if "ratio" in c["metric"]} == {"default"}  # the default 1.01
    assert [case["name"] for case in data["cases"]] == ["apc_ll", "apc_mc"]
    c = compare_eval_dirs(eval_runs["f32"], eval_runs["bf16"], Thresholds(max_accuracy_drop=-0.5))
    cases = c.cases()
    assert [(name, passed) for name, passed, _ in cases] == [("apc_ll", False), ("apc_mc", False)]
    assert "--max-accuracy-drop: apc_mc acc drop" in cases[1][2] and "acc_norm,none" in cases[1][2]


def test_exact_on_eval_folders(eval_runs, tmp_path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(eval_runs["f32"], copy)
    same = _compare(eval_runs["f32"], copy, "--exact")
    assert same.exit_code == 0 and "bit-identical" in same.output, same.output
    diff = _compare(eval_runs["f32"], eval_runs["bf16"], "--exact")
    assert diff.exit_code == 1, diff.output
    assert "first difference: record 'apc_ll/0/none/0', column response" in diff.output


def test_different_settings_are_refused_naming_what_differs(eval_runs) -> None:
    r = _compare(eval_runs["f32"], eval_runs["shots2"])
    assert r.exit_code == 2
    assert "num_fewshot: 1 vs 2" in r.output and "task apc_mc config num_fewshot: 1 vs 2" in r.output


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_other_tasks_documents_or_prompts_are_refused(eval_runs, tmp_path) -> None:
    f32 = eval_runs["f32"]
    fewer = _copy(f32, tmp_path / "fewer")
    res = json.loads((fewer / "results.json").read_text())
    del res["results"]["apc_ll"]
    (fewer / "results.json").write_text(json.dumps(res))
    r = _compare(f32, fewer)
    assert r.exit_code == 2 and "different tasks" in r.output and "['apc_mc']" in r.output

    docs = _copy(f32, tmp_path / "docs")
    t = pq.read_table(docs / "requests.parquet")
    keep = pa.array([not (task == "apc_mc" and doc == 5) for task, doc in
                     zip(t["task"].to_pylist(), t["doc_id"].to_pylist())])
    pq.write_table(t.filter(keep), docs / "requests.parquet")
    r = _compare(f32, docs)
    assert r.exit_code == 2 and "different documents" in r.output and "apc_mc doc 5" in r.output

    prompts = _copy(f32, tmp_path / "prompts")
    args = t["arguments"].to_pylist()
    args[0] = json.dumps(["another context", " Paris"])
    pq.write_table(t.set_column(t.column_names.index("arguments"), "arguments", pa.array(args)),
                   prompts / "requests.parquet")
    r = _compare(f32, prompts)
    assert r.exit_code == 2 and "different prompts" in r.output and "task apc_ll doc 0" in r.output


def test_inputs_that_are_not_two_eval_folders_are_refused(eval_runs, tmp_path) -> None:
    f32 = eval_runs["f32"]
    file = tmp_path / "x.parquet"
    shutil.copy(f32 / "requests.parquet", file)
    r = _compare(f32, file)
    assert r.exit_code == 2 and "baseline" in r.output and "is a directory" in r.output
    assert "not one of each" in r.output
    unfinished = _copy(f32, tmp_path / "unfinished")
    (unfinished / "results.json").unlink()
    r = _compare(f32, unfinished)
    assert r.exit_code == 2 and "has no results.json" in r.output
    r = _compare(f32, eval_runs["bf16"], "--max-mean-kld", "0.1")
    assert r.exit_code == 2 and "cannot be checked on eval runs" in r.output
    r = _compare(f32, eval_runs["bf16"], "--report-html", tmp_path / "r.html")
    assert r.exit_code == 2 and "--report-md" in r.output
    with pytest.raises(ApcscoreError, match="not a finished"):
        read_eval_dir(unfinished, "candidate")


def test_the_default_drop_limit_per_task_with_mcnemar_beside_it_and_junit_has_a_case_per_task(eval_runs,
                                                                                                 tmp_path) -> None:
    import scipy.stats as sps
    from junitparser import JUnitXml

    junit, report = tmp_path / "eval.xml", tmp_path / "eval.json"
    r = _compare(eval_runs["f32"], eval_runs["bf16"], "--significance", "0.05", "--report-junit", junit,
                 "--report-json", report)
    assert r.exit_code == 0, r.output  # 4-6 documents: no drop is significantly beyond 2 points
    base, new = _per_doc(eval_runs["f32"]), _per_doc(eval_runs["bf16"])
    checks = json.loads(report.read_text())["checks"]
    assert {c["task"] for c in checks} == {"apc_ll", "apc_mc"} and len(checks) == 4  # acc, acc, acc_norm, ppl
    for c in checks:
        if "ratio" in c["metric"]:
            continue
        task, metric = c["metric"].split(" drop")[0].split()
        keys = [k for k in base if k[:2] == (task, metric)]
        lost = sum(base[k] == 1 and new[k] == 0 for k in keys)
        gained = sum(base[k] == 0 and new[k] == 1 for k in keys)
        p = sps.binomtest(lost, lost + gained, 0.5).pvalue if lost + gained else 1.0
        assert f"McNemar p {p:.3g}: {lost} lost, {gained} gained" in c["bound"], c["bound"]
        assert c["value"] == pytest.approx((lost - gained) / len(keys), abs=1e-12)
        assert (c["source"], c["threshold"]) == ("default", 0.02) and c["bound"].startswith("lower 95% bound")
    suites = list(JUnitXml.fromfile(str(junit)))
    assert [case.name for case in suites[0]] == ["apc_ll", "apc_mc"] and all(case.is_passed for case in suites[0])


def test_a_drop_significantly_beyond_the_limit_fails_that_task_only() -> None:
    from apcscore.compare.eval_runs import EvalComparison, MetricDelta, evaluate_eval

    def metric(task: str, lost: int, gained: int) -> MetricDelta:
        return MetricDelta(task, "acc", "none", 0.8, 0.8 - (lost - gained) / 60, None, None, True, num_docs=60,
                           binary=True, flips_to_wrong=lost, flips_to_right=gained)

    c = EvalComparison({}, {}, ["a", "b"], [metric("a", 9, 0), metric("b", 5, 4)])
    evaluate_eval(c, Thresholds(max_accuracy_drop=0.02, significance=0.05))
    assert [(t, ch.passed) for ch, t in zip(c.checks, c.check_tasks)] == [("a", False), ("b", True)]
    # all 9 flips went one way: q >= 0.05 ** (1 / 9) (exact), so the drop is at least 9 (2 q - 1) / 60 > 2 points
    assert c.checks[0].bound.startswith(f"lower 95% bound {9 * (2 * 0.05 ** (1 / 9) - 1) / 60:.6g} (McNemar p "
                                        "0.00391: 9 lost")  # p = 2 * 0.5 ** 9
    assert [(name, ok) for name, ok, _ in c.cases()] == [("a", False), ("b", True)]
