"""Benchmark harness: run contenders as separate processes, repeat them interleaved, summarise.

Each contender of a scenario is one command line run as its own process, so its whole-process wall time
(interpreter start, imports, model load, compute, exit) and its peak RSS (from `os.wait4`, the kernel's
per-child rusage) are clean. A contender that is a benchmark worker also prints one line
`BENCH_REPORT {json}` with its in-process timings (load, compute) and where it saved its outputs.

Scenarios are plain data (`Scenario`): a driver (bench_cpu.py, bench_eval.py, ...) builds its inputs,
lists its contenders and gives a `check` that compares the contenders' saved outputs, so a benchmark
cannot silently compare different work.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

REPORT_PREFIX = "BENCH_REPORT "


@dataclass
class Contender:
    """One side of a scenario: a command line, run as its own process.

    name: row label (e.g. "apcscore", "transformers", "apcscore CLI").
    argv: the command; it may print a `BENCH_REPORT {json}` line (keys: load_s, compute_s, output, ...).
    baseline: the contender every other one is divided by (exactly one per scenario).
    output: where the contender writes its results, when it does not say so in a report (e.g. a CLI run).
    """

    name: str
    argv: list[str]
    baseline: bool = False
    output: str | None = None


@dataclass
class Scenario:
    """A benchmark scenario: contenders doing the same work, and a check that they did.

    work_tokens: the tokens of work (scored prompt tokens, or generated tokens) tokens/s is computed from.
    target_ratio: the ratio ours/baseline of whole-process time the issue asks for (None = none).
    check: (outputs by contender name) -> {contender: {measure: value}} against the baseline (or a flat
        {label: value}); outputs are each contender's report["output"] (or Contender.output) of its last run.
    """

    name: str
    description: str
    work_tokens: int
    work_unit: str
    contenders: list[Contender]
    target_ratio: float | None = None
    check: Callable[[dict[str, str]], dict[str, Any]] | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def baseline(self) -> Contender:
        (base,) = [c for c in self.contenders if c.baseline]
        return base


@dataclass
class RunResult:
    """One process run of one contender."""

    wall_s: float
    peak_rss_mb: float
    returncode: int
    report: dict[str, Any]
    stderr_tail: str = ""


def run_process(argv: list[str], env: dict[str, str] | None = None, cwd: str | Path | None = None) -> RunResult:
    """Run argv to completion; wall time from spawn to reap, peak RSS from the child's own rusage."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env, cwd=cwd)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped by wait4: tell Popen
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    report: dict[str, Any] = {}
    for line in stdout.splitlines():
        if line.startswith(REPORT_PREFIX):
            report = json.loads(line[len(REPORT_PREFIX):])
    # ru_maxrss is in KiB on Linux
    return RunResult(wall, usage.ru_maxrss / 1024, proc.returncode, report, stderr[-3000:])


def run_scenario(scenario: Scenario, repeats: int, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every contender `repeats` times, interleaved and rotated (A B C, B C A, C A B, ...: each contender
    takes each place in the order equally often, so a drift of the machine within a round favours nobody),
    and summarise with medians."""
    runs: dict[str, list[RunResult]] = {c.name: [] for c in scenario.contenders}
    n = len(scenario.contenders)
    for rep in range(repeats):
        for c in scenario.contenders[rep % n:] + scenario.contenders[:rep % n]:
            log(f"  [{scenario.name}] {c.name} run {rep + 1}/{repeats} ...")
            r = run_process(c.argv)
            if r.returncode != 0:
                raise RuntimeError(f"{scenario.name}/{c.name} failed with exit code {r.returncode}:\n"
                                   f"{' '.join(c.argv)}\n{r.stderr_tail}")
            log(f"    {r.wall_s:.2f} s whole process, {r.peak_rss_mb:.0f} MB peak RSS"
                + (f", {r.report['compute_s']:.2f} s compute" if "compute_s" in r.report else ""))
            runs[c.name].append(r)
    rows = []
    for c in scenario.contenders:
        rs = runs[c.name]
        computes = [r.report["compute_s"] for r in rs if "compute_s" in r.report]
        loads = [r.report["load_s"] for r in rs if "load_s" in r.report]
        wall = statistics.median(r.wall_s for r in rs)
        compute = statistics.median(computes) if computes else None
        rows.append({
            "contender": c.name, "baseline": c.baseline, "argv": c.argv, "runs": len(rs),
            "wall_s": wall, "wall_s_all": [round(r.wall_s, 3) for r in rs],
            "compute_s": compute, "compute_s_all": [round(x, 3) for x in computes],
            "load_s": statistics.median(loads) if loads else None,
            "tokens_per_s_wall": scenario.work_tokens / wall,
            "tokens_per_s_compute": scenario.work_tokens / compute if compute else None,
            "peak_rss_mb": max(r.peak_rss_mb for r in rs),
            "report": rs[-1].report,
        })
    base = next(r for r in rows if r["baseline"])
    for row in rows:
        row["ratio_wall"] = row["wall_s"] / base["wall_s"]
        row["ratio_compute"] = (row["compute_s"] / base["compute_s"]
                                if row["compute_s"] and base["compute_s"] else None)
    check = {}
    if scenario.check is not None:
        check = scenario.check({c.name: runs[c.name][-1].report.get("output") or c.output or ""
                                 for c in scenario.contenders})
    ours = [r for r in rows if not r["baseline"]]
    met = None
    if scenario.target_ratio is not None and ours:
        met = ours[0]["ratio_wall"] <= scenario.target_ratio
    return {"scenario": scenario.name, "description": scenario.description, "work_tokens": scenario.work_tokens,
            "work_unit": scenario.work_unit, "target_ratio_wall": scenario.target_ratio, "target_met": met,
            "info": scenario.info, "rows": rows, "check": check}


def machine_info() -> dict[str, Any]:
    """What the numbers depend on: CPU, cores, load, library versions."""
    import torch
    import transformers

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu, "cpu_count": os.cpu_count(), "load_avg_at_start": os.getloadavg(),
        "python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(results: list[dict[str, Any]]) -> str:
    """A Markdown table of every scenario's contenders (the format docs/benchmarks.md records)."""
    lines = [
        "| scenario | contender | work tokens | whole process s (median) | compute s (median) | load s "
        "| tokens/s (whole) | tokens/s (compute) | peak RSS MB | ratio whole | ratio compute | target |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for res in results:
        for row in res["rows"]:
            target = ""
            if not row["baseline"] and res["target_ratio_wall"] is not None and row is _first_ours(res):
                target = f"<= {res['target_ratio_wall']:.2f}x: {'met' if res['target_met'] else 'NOT met'}"
            lines.append(
                f"| {res['scenario']} | {row['contender']} | {res['work_tokens']:,} {res['work_unit']} "
                f"| {row['wall_s']:.2f} | {_fmt(row['compute_s'], '.2f')} | {_fmt(row['load_s'], '.2f')} "
                f"| {row['tokens_per_s_wall']:,.0f} | {_fmt(row['tokens_per_s_compute'], ',.0f')} "
                f"| {row['peak_rss_mb']:,.0f} | {row['ratio_wall']:.2f}x | {_fmt(row['ratio_compute'], '.2f')}"
                f"{'' if row['ratio_compute'] is None else 'x'} | {target} |")
    return "\n".join(lines)


def _first_ours(res: dict[str, Any]) -> dict[str, Any]:
    return next(r for r in res["rows"] if not r["baseline"])


def format_checks(results: list[dict[str, Any]]) -> str:
    """Did the contenders compute the same thing? One line per contender ({contender: {measure: value}}
    checks) or per scenario (flat {label: value} checks)."""
    out = []
    for res in results:
        check = res["check"]
        if not check:
            continue
        base = next(r["contender"] for r in res["rows"] if r["baseline"])
        if all(isinstance(v, dict) for v in check.values()):
            for name, measures in check.items():
                items = ", ".join(f"{k} {v}" for k, v in measures.items())
                out.append(f"- {res['scenario']}, {name} vs {base}: {items}")
        else:
            out.append(f"- {res['scenario']}: " + ", ".join(f"{k} = {v}" for k, v in check.items()))
    return "\n".join(out)


def format_taxes(results: list[dict[str, Any]], ours: str = "apcscore",
                 plain: str = "apcscore --no-batch-invariant") -> str:
    """The batch-invariance tax per scenario: median times of `ours` over `plain` (the same worker with library
    GEMMs), whole process and compute, as percentages; empty when no scenario has both contenders."""
    out = []
    for res in results:
        rows = {r["contender"]: r for r in res["rows"]}
        if ours in rows and plain in rows:
            a, b = rows[ours], rows[plain]
            compute = (f", compute {a['compute_s'] / b['compute_s'] - 1:+.1%}"
                       if a["compute_s"] and b["compute_s"] else "")
            out.append(f"- {res['scenario']}: whole process {a['wall_s'] / b['wall_s'] - 1:+.1%}{compute}")
    return "\n".join(out)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=_json_default) + "\n")


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return str(obj)
