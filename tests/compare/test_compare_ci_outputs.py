"""`apcscore compare`'s CI outputs: the JUnit file (read back with junitparser, a real consumer), GitHub workflow
commands (`::error` / `::notice`, escaped as GitHub's runner requires) and the job summary appended to
$GITHUB_STEP_SUMMARY."""

from __future__ import annotations

from pathlib import Path

import pytest
from junitparser import Failure, JUnitXml
from test_compare import mc_rows, one_line, run_cli, write_results

from apcscore.compare.ci_outputs import Case, annotation, annotations, to_junit


def _files(tmp_path: Path) -> tuple[Path, Path]:
    """Five multiple-choice questions: accuracy 0.8 in the baseline, 0.6 in the candidate."""
    answers = [0, 1, 2, 0, 1]
    return (write_results(tmp_path / "a.parquet", mc_rows([0, 1, 2, 1, 1], [0, 1, 2, 0, 1], answers)),
            write_results(tmp_path / "b.parquet", mc_rows([0, 2, 2, 0, 0], [0, 1, 2, 0, 1], answers)))


def test_junit_has_one_testcase_per_threshold_with_the_figures(tmp_path) -> None:
    base, new = _files(tmp_path)
    junit = tmp_path / "out" / "compare.xml"
    r = run_cli(base, new, "--decision", "point", "--max-accuracy-drop", 0.1, "--report-junit", junit)
    assert r.exit_code == 1, r.output
    xml = JUnitXml.fromfile(str(junit))
    suites = list(xml)
    assert len(suites) == 1 and suites[0].tests == 4 and suites[0].failures == 1 and suites[0].errors == 0
    cases = {c.name: c for c in suites[0]}
    assert set(cases) == {"--max-new-errors: records ok in baseline, error in candidate",
                          "--max-broken: positions and records with NaN, +-inf or a one-sided value",
                          "--max-accuracy-drop: accuracy drop (base - new)",
                          "--max-accuracy-drop: acc_norm drop (base - new)"}
    failed = cases["--max-accuracy-drop: accuracy drop (base - new)"]
    assert not failed.is_passed and isinstance(failed.result[0], Failure)
    assert failed.result[0].message == "accuracy drop (base - new) = 0.2, limit <= 0.1 (option): FAIL"
    assert cases["--max-accuracy-drop: acc_norm drop (base - new)"].is_passed
    # a passing gate: every case passes; the file is replaced (an earlier report), not refused
    assert run_cli(base, new, "--decision", "point", "--max-accuracy-drop", 0.25,
                   "--report-junit", junit).exit_code == 0
    suite = list(JUnitXml.fromfile(str(junit)))[0]
    assert suite.tests == 4 and suite.failures == 0 and all(c.is_passed for c in suite)
    # a file that is not a report is not replaced
    other = tmp_path / "notes.xml"
    other.write_text("<notes/>")
    r = run_cli(base, new, "--report-junit", other)
    assert r.exit_code == 2 and "is not a report of apcscore compare" in one_line(r.stderr)


def test_junit_writer_takes_generic_cases_and_escapes_xml(tmp_path) -> None:
    cases = [Case("task <arc> & \"hard\"", False, "acc 0.5 < 0.6\nsecond line", classname="apcscore.eval"),
             Case("task b", True, "acc 0.9")]
    path = tmp_path / "j.xml"
    path.write_text(to_junit(cases, "eval tasks"))
    suite = list(JUnitXml.fromfile(str(path)))[0]
    assert suite.name == "eval tasks" and suite.tests == 2 and suite.failures == 1
    first = list(suite)[0]
    assert first.name == 'task <arc> & "hard"' and first.classname == "apcscore.eval"
    assert first.result[0].message == "acc 0.5 < 0.6\nsecond line"
    path.write_text(to_junit([]))
    assert list(JUnitXml.fromfile(str(path)))[0].tests == 0


def test_workflow_commands_are_escaped_as_github_requires() -> None:
    # toolkit/core: data escapes % \r \n; properties also : and ,
    assert annotation("error", "a: b, c", "50% of\r\nrecords") == "::error title=a%3A b%2C c::50%25 of%0D%0Arecords"
    lines = annotations([Case("x", False, "m1"), Case("y", True, "m2")], "FAIL (1 of 2 thresholds)")
    assert lines == ["::error title=apcscore compare%3A x::m1", "::notice title=apcscore compare::FAIL (1 of 2 "
                                                                "thresholds)"]


def test_github_actions_annotations_and_step_summary(tmp_path, monkeypatch) -> None:
    base, new = _files(tmp_path)
    summary = tmp_path / "step_summary.md"
    summary.write_text("earlier step\n")
    # not in GitHub Actions (conftest clears the variables)
    r = run_cli(base, new, "--decision", "point", "--max-accuracy-drop", 0.1)
    assert "::error" not in r.output and "::notice" not in r.output
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    r = run_cli(base, new, "--decision", "point", "--max-accuracy-drop", 0.1)
    assert r.exit_code == 1
    lines = r.output.splitlines()
    assert ("::error title=apcscore compare%3A --max-accuracy-drop%3A accuracy drop (base - new)::accuracy drop "
            "(base - new) = 0.2, limit <= 0.1 (option): FAIL") in lines
    assert sum(line.startswith("::error") for line in lines) == 1
    assert "::notice title=apcscore compare::FAIL (1 of 4 thresholds)" in lines
    text = summary.read_text()
    assert text.startswith("earlier step\n\n## apcscore compare: ❌ FAIL (1 of 4 thresholds)")  # appended
    # --report-md naming the summary file itself appends the report once (not twice), keeping what came before
    r = run_cli(base, new, "--decision", "point", "--max-accuracy-drop", 0.25, "--report-md", summary)
    assert r.exit_code == 0 and "::notice title=apcscore compare::PASS" in r.output.splitlines()
    after = summary.read_text()
    assert after.startswith(text) and after.count("## apcscore compare:") == 2
    assert after[len(text):].startswith("\n## apcscore compare: ✅ PASS")  # a blank line between the two


def test_report_md_appends_to_the_step_summary_as_the_ci_recipe_writes_it(tmp_path, monkeypatch) -> None:
    """Issue 52, item 8: `--report-md "$GITHUB_STEP_SUMMARY"` (README, examples/ci) replaced the summary, or was
    refused (exit 2) when an earlier command of the step had written to it; GitHub appends a step's writes."""
    base, new = _files(tmp_path)
    summary = tmp_path / "step_summary.md"
    summary.write_text("| earlier | table |\n|---|---|\n| a | b |")  # no newline at the end
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    for _ in range(2):  # each run adds its report
        r = run_cli(base, new, "--max-accuracy-drop", 0.25, "--report-md", summary)
        assert r.exit_code == 0, r.output
    text = summary.read_text()
    assert text.startswith("| earlier | table |\n|---|---|\n| a | b |\n\n## apcscore compare: ✅ PASS")
    assert text.count("## apcscore compare: ✅ PASS") == 2 and "\n\n\n" not in text
    # another path is still written whole: a local rerun does not pile reports up
    md = tmp_path / "r.md"
    for _ in range(2):
        assert run_cli(base, new, "--max-accuracy-drop", 0.25, "--report-md", md).exit_code == 0
    assert md.read_text().count("## apcscore compare:") == 1


@pytest.mark.parametrize("value", ["false", ""])
def test_annotations_only_when_github_actions_is_true(tmp_path, monkeypatch, value: str) -> None:
    base, new = _files(tmp_path)
    monkeypatch.setenv("GITHUB_ACTIONS", value)
    assert "::" not in run_cli(base, new, "--decision", "point", "--max-accuracy-drop", 0.1).output


def test_a_usage_error_is_an_annotation_too(tmp_path, monkeypatch) -> None:
    base, _ = _files(tmp_path)
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    r = run_cli(base, base, "--max-mean-kld", 0.1)  # multiple-choice files hold no top-K: exit 2
    assert r.exit_code == 2
    line = next(x for x in r.output.splitlines() if x.startswith("::error"))
    assert line.startswith("::error title=apcscore compare%3A nothing compared (exit 2)::--max-mean-kld cannot be "
                           "checked")
