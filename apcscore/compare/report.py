"""Reports of `apcscore compare`: a Rich table for the terminal, Markdown for a CI job summary, JSON."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from apcscore.compare.fit_table import Row, print_table
from apcscore.compare.gate import Check, Comparison
from apcscore.compare.inputs import FileInfo, run_differences
from apcscore.compare.stats import PairedStats
from apcscore.errors import ApcscoreError


def _num(v: float | None, digits: int = 6, sign: bool = False) -> str:
    return "-" if v is None else f"{v:{'+' if sign else ''}.{digits}g}"


def _pct(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{100 * v:.{digits}f}%"


def _diff(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{b - a:+.6g}"


def _sides(c: Comparison) -> list[Row]:
    """Who was compared: one row per property, baseline and candidate."""
    def side(f: FileInfo) -> Row:
        return (f.path, f.command or "-", f.model or "-", f.dtype or "-", str(f.top_k),
                f"{f.dataset or '-'} ({(f.dataset_sha256 or '-')[:12]})")

    return list(zip(("file", "command", "model", "dtype", "top-K stored", "dataset"), side(c.base), side(c.new)))


DIFFER_HEAD = ("property", "baseline", "candidate")
_NOT_RECORDED = "(not recorded)"


def _differ_rows(c: Comparison) -> list[Row]:
    """The run properties that differ between the two files (`inputs.run_differences`), one row each."""
    return [(d.property, d.baseline or _NOT_RECORDED, d.candidate or _NOT_RECORDED)
            for d in run_differences(c.base, c.new)]


def differ_line(c: Comparison) -> str | None:
    """The sentence shown instead of the "runs differ in" table when nothing the metadata records differs."""
    if _differ_rows(c):
        return None
    return ("the runs differ in nothing their metadata records (apcscore version, numerics code, model, weights "
            "fingerprint, dtype, device, backends, numerics, dataset, top-K)")


def _metric_rows(c: Comparison) -> list[Row]:
    """(metric, baseline, candidate, change) for every overall figure that was computed."""
    m = c.metrics
    rows: list[Row] = [
        ("records compared", str(c.num_compared), f"of {c.num_records}", f"{len(c.excluded)} excluded"),
        ("positions compared", str(m.num_positions), "", ""),
        ("mean NLL", _num(m.mean_nll_base), _num(m.mean_nll_new), _diff(m.mean_nll_base, m.mean_nll_new)),
        ("perplexity", _num(m.ppl_base), _num(m.ppl_new), f"ratio {_num(m.ppl_ratio)}"),
    ]
    if m.mean_ln_ppl_ratio is not None:
        rows.append(("mean ln(PPL_new / PPL_base)", "", "", f"{m.mean_ln_ppl_ratio:+.6g}{_pm(m.mean_ln_ppl_ratio_se)}"))
    for name, base, new in (("word perplexity", m.word_ppl_base, m.word_ppl_new),
                            ("bits per byte", m.bits_per_byte_base, m.bits_per_byte_new)):
        if base is not None:
            rows.append((name, _num(base), _num(new), _diff(base, new)))
    dp = m.delta_p
    rows += [
        ("same top p (top-1 agreement)", "", "", _pct(m.top1_agreement) + _pm(m.top1_agreement_se, True)),
        ("mean delta p (target)", "", "", _pct(m.mean_delta_p, 4) + _pm(dp.mean_se if dp else None, True)),
        ("RMS delta p (target)", "", "", _pct(m.rms_delta_p, 4) + _pm(dp.rms_se if dp else None, True)),
        ("max |delta logprob|", "", "", _num(m.max_abs_logprob_diff)),
    ]
    for name, kind, base, new in (
            (f"accuracy ({m.num_choice_records} choice records)", "acc", m.accuracy_base, m.accuracy_new),
            ("acc_norm", "acc_norm", m.accuracy_norm_base, m.accuracy_norm_new)):
        if base is not None:
            rows.append((name, _pct(base, 2), _pct(new, 2), f"{sum(f.kind == kind for f in c.flips)} flipped"))
    return rows


def _pm(se: float | None, pct: bool = False) -> str:
    """" +/- SE" (in percent when pct), or nothing without one."""
    return "" if se is None else f" +/- {_pct(se, 4) if pct else _num(se, 3)}"


def _stats_tables(s: PairedStats) -> list[tuple[str, Row, list[Row]]]:
    """The paired statistics: bootstrap intervals of the per-record deltas, and McNemar tests."""
    conf, out = f"{100 * s.confidence:g}%", []
    if s.intervals:
        rows = []
        for iv in s.intervals:
            # accuracy deltas in percentage points, the ln PPL ratio in nats
            f = (lambda v: f"{100 * v:+.2f}%") if iv.worse_if == "negative" else (lambda v: f"{v:+.4g}")
            rows.append((iv.figure, str(iv.num_records), f(iv.estimate), f"[{f(iv.low)}, {f(iv.high)}]",
                         f(iv.se).lstrip("+"), f(iv.mde).lstrip("+")))
            if iv.figure == "ln PPL ratio":
                rows.append(("PPL ratio (exp of the above)", str(iv.num_records), _num(math.exp(iv.estimate)),
                             f"[{_num(math.exp(iv.low))}, {_num(math.exp(iv.high))}]", "-", "-"))
        out.append((f"Paired bootstrap over records (candidate - baseline; {s.samples} resamples, seed {s.seed})",
                    ("figure", "records", "change", f"{conf} interval", "SE", f"min. detectable (power {s.power:g})"),
                    rows))
    if s.mcnemar:
        out.append((f"McNemar exact test (alpha {s.alpha:g})",
                    ("metric", "records", "lost (right to wrong)", "gained (wrong to right)", "p (two-sided)",
                     f"min. detectable drop (power {s.power:g})"),
                    [(t.kind, str(t.num_records), str(t.lost), str(t.gained), _num(t.p_value, 4), _pct(t.mde, 2))
                     for t in s.mcnemar]))
    return out


def _extra_tables(c: Comparison) -> list[tuple[str, Row, list[Row]]]:
    """(title, head, rows) of the tables below the metrics: llama.cpp's KL block (mean, its SE, max, percentiles
    99.9 down to 0.1, min), its delta p block (in percent: max, percentiles, min), the paired statistics."""
    out = []
    if (k := c.metrics.kld) is not None:
        out.append((f"KL(base || new) per position, nats ({c.kl_label})",
                    ("positions", "mean", "+/- SE", "max", *(f"{p}%" for p in k.percentiles), "min"),
                    [(str(k.num_positions), _num(k.mean), _num(k.mean_se, 3), _num(k.max),
                      *(_num(v) for v in k.percentiles.values()), _num(k.min))]))
    if (d := c.metrics.delta_p) is not None:
        out.append(("Delta p of the target token per position (candidate - baseline)",
                    ("max", *(f"{p}%" for p in d.percentiles), "min"),
                    [(_pct(d.max, 4), *(_pct(v, 4) for v in d.percentiles.values()), _pct(d.min, 4))]))
    return out + (_stats_tables(c.stats) if c.stats is not None else [])


def check_rows(checks: list[Check]) -> list[Row]:
    """One row per check (CHECK_HEAD): the option, what it measures, value, limit, the confidence bound it read
    ("the value" when it judged the value itself), where the limit came from, and the result."""
    return [(ch.option, ch.metric, _num(ch.value), f"{ch.op} {_num(ch.threshold)}", ch.bound or "the value",
             ch.source, "PASS" if ch.passed else "FAIL") for ch in checks]


def _worst_rows(c: Comparison, worst: int) -> list[Row]:
    return [(r.id, str(r.num_positions), _num(r.mean_kld), _num(r.max_kld), f"{r.ln_ppl_ratio:+.4g}",
             _pct(r.top1_agreement, 1), _num(r.max_abs_logprob_diff, 4)) for r in c.records[:worst]]


_WORST_HEAD = ("record", "positions", "mean KL", "max KL", "ln PPL ratio", "top-1 agree", "max |d logprob|")
_FLIP_HEAD = ("record", "metric", "answer", "pred base", "pred new", "correct base", "correct new")
CHECK_HEAD = ("threshold", "measures", "value", "limit", "judged by", "limit from", "result")
CONSOLE_CHECK_HEAD = ("threshold (from)", "measures", "value", "limit", "result")
EXCLUDED_HEAD = ("record", "failed in", "error")
LEFT_OUT_HEAD = ("record", "why")


def _left_out_rows(c: Comparison) -> list[Row]:
    """The records --common-records left out: only in one file, or edited (another input)."""
    lo = c.left_out
    return ([(r, "only in the baseline") for r in lo.only_baseline]
            + [(r, "only in the candidate") for r in lo.only_candidate]
            + [(r, f"edited: {why}") for r, why in lo.edited])


def _flip_rows(c: Comparison) -> list[Row]:
    return [(f.id, f.kind, str(f.answer), str(f.pred_base), str(f.pred_new), str(f.correct_base), str(f.correct_new))
            for f in c.flips]


def _excluded_rows(c: Comparison) -> list[Row]:
    return [(e.id, e.side, e.error) for e in c.excluded]


def _record_tables(c: Comparison, worst: int) -> list[tuple[str, Row, list[Row]]]:
    """(title, head, rows) of the record lists below the figures: the worst, flips, excluded and left out."""
    out = []
    if c.records and worst:
        out.append((f"Worst {min(worst, len(c.records))} records", _WORST_HEAD, _worst_rows(c, worst)))
    if c.flips:
        out.append(("Multiple-choice predictions that flipped", _FLIP_HEAD, _flip_rows(c)))
    if c.excluded:
        out.append(("Excluded records (status 'error')", EXCLUDED_HEAD, _excluded_rows(c)))
    if c.left_out.count:
        out.append(("Records left out (--common-records)", LEFT_OUT_HEAD, _left_out_rows(c)))
    return out


def verdict(checks: list[Check]) -> str:
    """The gate's one-line verdict over its checks (result files and eval folders alike)."""
    if not checks:
        return "no thresholds given"
    failed = sum(not ch.passed for ch in checks)
    return "PASS" if not failed else f"FAIL ({failed} of {len(checks)} thresholds)"


def print_checks(console: Console, notes: list[str], checks: list[Check], title: str = "Thresholds") -> None:
    """The end of a console report, result files and eval folders alike: the notes, the checks' table and the verdict.
    The table has five columns (CONSOLE_CHECK_HEAD), so that it fits 80: where the limit came from under the option,
    the bound under what is measured."""
    for note in notes:
        console.print(f"[yellow]note:[/] {escape(note)}", soft_wrap=True)
    if checks:
        rows = [(f"{opt}\n({source})", metric if bound == "the value" else f"{metric}\n{bound}", value, limit, result)
                for opt, metric, value, limit, bound, source, result in check_rows(checks)]
        print_table(console, title, CONSOLE_CHECK_HEAD, rows, ["green" if ch.passed else "bold red" for ch in checks])
    passed = all(ch.passed for ch in checks)
    style = "green" if passed and checks else "bold red" if not passed else "yellow"
    console.print(f"[{style}]{escape(verdict(checks))}[/]")


def render_console(c: Comparison, console: Console, worst: int = 10) -> None:
    """Print the comparison as Rich tables; failing thresholds in red."""
    print_table(console, "Compared runs", ("", "baseline", "candidate"), _sides(c))
    if (same := differ_line(c)) is not None:
        console.print(escape(same), highlight=False)
    else:
        print_table(console, "Runs differ in", DIFFER_HEAD, _differ_rows(c))
    print_table(console, "Metrics", ("metric", "baseline", "candidate", "change"), _metric_rows(c))
    for title, head, rows in _extra_tables(c) + _record_tables(c, worst):
        print_table(console, title, head, rows)
    print_checks(console, c.notes, c.checks)


def md_table(head: Row, rows: list[Row]) -> str:
    """A Markdown table (pipes in cells escaped)."""
    def cell(x: str) -> str:
        return x.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(x) for x in head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def md_report(title: str, checks: list[Check], lead: str, tables: list[tuple[str, Row, list[Row]]],
              notes: list[str]) -> str:
    """A Markdown report, result files and eval folders alike: the verdict and the checks' table, `lead` (a line,
    or nothing), the (title, head, rows) tables and the notes."""
    icon = "✅" if checks and all(ch.passed for ch in checks) else "ℹ️" if not checks else "❌"
    out = [f"## {title}: {icon} {verdict(checks)}", ""]
    if checks:
        rows = [(*r[:-1], ("✅ " if r[-1] == "PASS" else "❌ ") + r[-1]) for r in check_rows(checks)]
        out += [md_table(CHECK_HEAD, rows), ""]
    out += [lead, ""] if lead else []
    for name, head, rows in tables:
        out += [f"### {name}", "", md_table(head, rows), ""]
    return "\n".join(out + [f"> note: {n}" for n in notes]).rstrip() + "\n"


def to_markdown(c: Comparison, worst: int = 10) -> str:
    """The comparison as GitHub-flavoured Markdown (e.g. for $GITHUB_STEP_SUMMARY)."""
    same = differ_line(c)
    tables = [] if same else [("Runs differ in", DIFFER_HEAD, _differ_rows(c))]
    tables += [("Metrics", ("metric", "baseline", "candidate", "change"), _metric_rows(c)), *_extra_tables(c),
               *_record_tables(c, worst), ("Compared runs", ("", "baseline", "candidate"), _sides(c))]
    return md_report("apcscore compare", c.checks, f"_{same}_" if same else "", tables, c.notes)


def to_json(c: Comparison) -> str:
    """Every figure of the comparison, per record included, as JSON (NaN becomes null)."""
    data = c.to_dict()
    data["run_differences"] = [asdict(d) for d in run_differences(c.base, c.new)]
    return json.dumps(data, indent=2, allow_nan=False)


def write_report(path: Path, text: str) -> None:
    """Write a report file, creating its folder; a failure is a usage error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise ApcscoreError(f"cannot write report {path}: {e}") from None
