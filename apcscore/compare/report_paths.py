"""Where `apcscore compare` may write its reports, checked before anything is compared: never over an input or
another report, and over an existing file only when it is an earlier report of compare (or empty) or with
--overwrite. `--report-md "$GITHUB_STEP_SUMMARY"` is appended to (ci_outputs.write_markdown)."""

from __future__ import annotations

import os
from pathlib import Path

from apcscore.errors import ApcscoreError


def is_step_summary(path: Path) -> bool:
    """Whether `path` is the file $GITHUB_STEP_SUMMARY names (its Markdown report is appended, never replaces it)."""
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    return bool(summary) and _same(Path(summary), Path(path))

# The first characters of each report compare writes (report.to_markdown, to_json, html_report.to_html,
# ci_outputs.to_junit).
_REPORT_STARTS = ("## apcscore compare:", '{\n  "passed": ',
                  '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>apcscore compare:',
                  '<?xml version="1.0" encoding="UTF-8"?>\n<testsuites name="apcscore compare"')


def _same(a: Path, b: Path) -> bool:
    """Whether two paths name the same file (through links too); a missing path is compared resolved."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


def _is_report(path: Path) -> bool:
    """Whether an existing regular file is empty or an earlier report of compare."""
    try:
        with path.open("rb") as f:
            head = f.read(160).decode("utf-8", errors="replace")
    except OSError:
        return False
    return head == "" or head.startswith(_REPORT_STARTS)


def check_report_paths(reports: dict[str, Path | None], inputs: dict[str, Path | None], overwrite: bool) -> None:
    """Refuse report paths (option -> path) that would replace an input (role -> path), each other, or a file that is
    not a report; None is an option or input not given."""
    given = [(opt, p) for opt, p in reports.items() if p is not None]
    for i, (opt, path) in enumerate(given):
        for role, src in inputs.items():
            if src is not None and _same(path, src):
                raise ApcscoreError(f"{opt} {path} is the {role} itself; writing the report there would replace "
                                    "it — choose another path")
        for other, prev in given[:i]:
            if _same(path, prev):
                raise ApcscoreError(f"{other} and {opt} are both {path} — give each report its own path")
        if path.is_dir():
            raise ApcscoreError(f"{opt} {path} is a directory — give a file name such as report.md")
        if path.is_file() and not overwrite and not _is_report(path) and not is_step_summary(path):
            raise ApcscoreError(f"{opt} {path} exists and is not a report of apcscore compare — pass --overwrite "
                                "to replace it, or choose another path")
