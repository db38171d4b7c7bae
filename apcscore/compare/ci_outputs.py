"""Outputs of `apcscore compare` that CI systems read natively: JUnit XML (`--report-junit`, one testcase per
generic `Case`), GitHub Actions workflow commands and the job summary, and `--report-md`, appended to when it is
the file `$GITHUB_STEP_SUMMARY` names (docs/compare.md, "Reports" and "Reading the output in CI")."""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from apcscore.compare.gate import Check
from apcscore.compare.report_paths import is_step_summary
from apcscore.errors import ApcscoreError

SUITES_NAME = "apcscore compare"  # the <testsuites> name; report_paths knows a JUnit report by it


@dataclass(frozen=True)
class Case:
    """One pass/fail unit of a gate: a JUnit testcase, a GitHub annotation when it fails."""

    name: str  # e.g. "--max-ppl-ratio: PPL ratio (new / base)"
    passed: bool
    message: str  # the figures: value, limit, what was measured
    classname: str = "apcscore.compare"


def checks_to_cases(checks: Iterable[Check]) -> list[Case]:
    """One case per threshold check of `apcscore compare`, named by option and figure."""
    return [Case(f"{ch.option}: {ch.metric}", ch.passed,
                 f"{ch.metric} = {ch.value:.6g}, limit {ch.op} {ch.threshold:.6g} ({ch.source}"
                 f"{'; ' + ch.bound if ch.bound else ''}): {'PASS' if ch.passed else 'FAIL'}") for ch in checks]


def to_junit(cases: list[Case], suite: str = "thresholds") -> str:
    """JUnit XML: one <testsuite name=suite> in <testsuites name="apcscore compare">, a <failure> (message = the
    figures) per failed case, the figures in <system-out> of each passed one; no case gives tests="0"."""
    failures = sum(not c.passed for c in cases)
    counts = {"tests": str(len(cases)), "failures": str(failures), "errors": "0", "skipped": "0", "time": "0"}
    root = ET.Element("testsuites", {"name": SUITES_NAME, **counts})
    ts = ET.SubElement(root, "testsuite", {"name": suite, **counts})
    for c in cases:
        tc = ET.SubElement(ts, "testcase", {"classname": c.classname, "name": c.name, "time": "0"})
        if c.passed:
            ET.SubElement(tc, "system-out").text = c.message
        else:
            ET.SubElement(tc, "failure", {"message": c.message, "type": "threshold"}).text = c.message
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def _escape_data(s: str) -> str:
    """A workflow command's message, escaped as GitHub's runner (toolkit/core `escapeData`) does."""
    return s.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(s: str) -> str:
    """A workflow command's property value (title=...), escaped as `escapeProperty`: also ':' and ','."""
    return _escape_data(s).replace(":", "%3A").replace(",", "%2C")


def annotation(kind: str, title: str, message: str) -> str:
    """One GitHub workflow command line, e.g. `::error title=T::M` (kind: error | warning | notice)."""
    return f"::{kind} title={_escape_property(title)}::{_escape_data(message)}"


def annotations(cases: list[Case], verdict: str) -> list[str]:
    """`::error` per failed case and one `::notice` with the verdict."""
    lines = [annotation("error", f"{SUITES_NAME}: {c.name}", c.message) for c in cases if not c.passed]
    return lines + [annotation("notice", SUITES_NAME, verdict)]


def _append(path: Path, text: str, what: str) -> None:
    """Append `text` to `path`, after a blank line when the file already holds something (Markdown blocks of
    several writers then stay apart)."""
    try:
        tail = path.read_bytes()[-2:] if path.is_file() else b""  # a step summary is small (GitHub: 1 MiB at most)
        sep = "" if not tail or tail.endswith(b"\n\n") else "\n" if tail.endswith(b"\n") else "\n\n"
        with open(path, "a", encoding="utf-8") as f:
            f.write(sep + text)
    except OSError as e:
        raise ApcscoreError(f"cannot append the summary to {what}: {e}") from None


def write_markdown(path: Path, text: str) -> None:
    """`--report-md PATH`: appended when PATH is $GITHUB_STEP_SUMMARY (a step summary collects what the step writes;
    replacing it would erase what came before), else written whole (report.write_report)."""
    if is_step_summary(path):
        _append(path, text, f"--report-md {path} ($GITHUB_STEP_SUMMARY)")
        return
    from apcscore.compare.report import write_report

    write_report(path, text)


def github_outputs(cases: list[Case], verdict: str, markdown: Callable[[], str], report_md: Path | None,
                   echo: Callable[[str], None] = print) -> None:
    """GitHub Actions: annotations of `cases` and the verdict when GITHUB_ACTIONS is "true", and `markdown()` appended
    to GITHUB_STEP_SUMMARY's file unless --report-md is that file."""
    if os.environ.get("GITHUB_ACTIONS") == "true":
        for line in annotations(cases, verdict):
            echo(line)
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary and not (report_md is not None and is_step_summary(report_md)):
        _append(Path(summary), markdown(), f"GITHUB_STEP_SUMMARY={summary}")
