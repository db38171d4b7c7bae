"""Reports of `apcscore compare` on two eval folders: Rich tables, Markdown (for a CI job summary), JSON."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from apcscore.compare.eval_runs import EvalComparison, MetricDelta
from apcscore.compare.thresholds import Thresholds
from apcscore.compare.fit_table import Row, print_table
from apcscore.compare.report import _num, md_report, print_checks, verdict
from apcscore.errors import ApcscoreError

_METRIC_HEAD = ("task", "metric", "baseline", "candidate", "change", "docs", "per-doc change +/- SE", "flips -/+")


def _with_se(v: float | None, se: float | None) -> str:
    return "-" if v is None else _num(v, 4, sign=True) + (f" +/- {se:.2g}" if se is not None else "")


def _metric_row(m: MetricDelta) -> Row:
    name = m.metric if m.filter == "none" else f"{m.metric} ({m.filter})"
    return (m.task, name, _with_se(m.base, m.base_stderr).lstrip("+"), _with_se(m.new, m.new_stderr).lstrip("+"),
            _num(m.delta, 4, sign=True), str(m.num_docs), _with_se(m.mean_doc_delta, m.doc_delta_se),
            f"{m.flips_to_wrong} / {m.flips_to_right}" if m.binary else "-")


def _sides(c: EvalComparison) -> list[Row]:
    return [(k, str(c.base.get(k) or "-"), str(c.new.get(k) or "-")) for k in c.base]


def render_eval_console(c: EvalComparison, console: Console) -> None:
    """Print the comparison as Rich tables; failing thresholds in red."""
    print_table(console, "Compared eval runs", ("", "baseline", "candidate"), _sides(c))
    print_table(console, "Per task and metric (flips: documents right -> wrong / wrong -> right)", _METRIC_HEAD,
                [_metric_row(m) for m in c.metrics])
    print_checks(console, c.notes, c.checks, "Thresholds (per task)")


def eval_markdown(c: EvalComparison) -> str:
    """The comparison as GitHub-flavoured Markdown (e.g. for $GITHUB_STEP_SUMMARY)."""
    return md_report("apcscore compare (eval runs)", c.checks, "",
                     [("Per task and metric", _METRIC_HEAD, [_metric_row(m) for m in c.metrics]),
                      ("Compared runs", ("", "baseline", "candidate"), _sides(c))], c.notes)


def run_eval_compare(baseline: Path, candidate: Path, thresholds: Thresholds, exact: bool, report_md: Path | None,
                     report_json: Path | None, report_html: Path | None, report_junit: Path | None,
                     console: Console) -> bool:
    """The command on two eval folders: compare, print, write the reports (JUnit: one testcase per task) and the
    GitHub outputs; returns whether the gate passed."""
    from apcscore.compare.ci_outputs import Case, github_outputs, to_junit, write_markdown
    from apcscore.compare.eval_runs import compare_eval_dirs, exact_eval
    from apcscore.compare.gate import add_exact
    from apcscore.compare.report import write_report

    if report_html is not None:
        raise ApcscoreError("--report-html draws per-token figures of result files; eval folders have none: use "
                            "--report-md or --report-json")
    if baseline.is_dir() != candidate.is_dir():
        d, f = (("baseline", baseline), ("candidate", candidate))[::1 if baseline.is_dir() else -1]
        raise ApcscoreError(f"{d[0]} {d[1]} is a directory and {f[0]} {f[1]} is not: compare takes two result files "
                            "(the parquet files of apcscore score or perplexity) or two apcscore eval output folders, "
                            "not one of each")
    result = compare_eval_dirs(baseline, candidate, thresholds)
    if exact:
        add_exact(result.checks, result.notes, exact_eval(baseline, candidate))
        result.check_tasks.append("exact")
    render_eval_console(result, console)
    if report_md is not None:
        write_markdown(report_md, eval_markdown(result))
    if report_json is not None:
        write_report(report_json, json.dumps(result.to_dict(), indent=2, allow_nan=False))
    cases = [Case(name, passed, message, classname="apcscore.compare.eval") for name, passed, message in result.cases()]
    if report_junit is not None:
        write_report(report_junit, to_junit(cases, "eval tasks"))
    github_outputs(cases, verdict(result.checks), lambda: eval_markdown(result), report_md)
    return result.passed
