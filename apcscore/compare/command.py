"""`apcscore compare BASELINE.parquet CANDIDATE.parquet`: the CI regression gate.

Exit codes: 0 every threshold holds, 1 a threshold fails, 2 input or usage error (nothing compared). The metrics
modules are imported when the command runs, so that `apcscore --help` stays fast."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from apcscore.errors import ApcscoreError

if TYPE_CHECKING:
    from apcscore.compare.gate import Comparison


def compare(
    baseline: Annotated[Path, typer.Argument(help="Result file of the reference run (apcscore score / perplexity), "
                                                  "or its apcscore eval output folder.",
                                             show_default=False)],
    candidate: Annotated[Optional[Path], typer.Argument(
        help="Result file (or eval folder) of the run under test, same data. Left out: the baseline file was scored "
             "with --reference-model and is compared with its reference (exact KL).", show_default=False)] = None,
    max_ppl_ratio: Annotated[Optional[float], typer.Option(
        help="Fail when PPL_new / PPL_base is above this (e.g. 1.01).")] = None,
    max_mean_kld: Annotated[Optional[float], typer.Option(
        help="Fail when the mean KL(base || new) per token, in nats, is above this (needs top-K logprobs).")] = None,
    min_top1_agreement: Annotated[Optional[float], typer.Option(
        help="Fail when the share of positions with the same argmax token is below this (0..1).")] = None,
    max_abs_logprob_diff: Annotated[Optional[float], typer.Option(
        help="Fail when some target token's logprob moved by more than this.")] = None,
    max_accuracy_drop: Annotated[Optional[float], typer.Option(
        help="Fail when multiple-choice accuracy (or acc_norm) drops by more than this fraction "
             "(0.02 = 2 points).")] = None,
    significance: Annotated[Optional[float], typer.Option(
        help="Level alpha of the one-sided confidence bounds (paired bootstrap over records) that each tolerance is "
             "judged by (docs/compare.md, \"Margins\").  \\[default: 0.05]")] = None,
    decision: Annotated[Optional[str], typer.Option(
        help="margin: fail when a worsening is significantly beyond its tolerance; strict: pass only when it is "
             "significantly within (small, noisy sets); point: compare the estimates alone.  \\[default: margin]",
        show_default=False)] = None,
    default_gate: Annotated[bool, typer.Option(
        "--default-gate/--no-default-gate",
        help="Apply the default limits (PPL ratio, mean KL, top-1 agreement, accuracy drop; docs/compare.md, "
             "\"The default gate\") to every figure no option or config file sets.")] = True,
    bootstrap_samples: Annotated[int, typer.Option(
        min=100, help="Resamples of the paired bootstrap of the per-record deltas.")] = 2000,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the bootstrap: the same seed gives the same intervals.")
                    ] = 0,
    config: Annotated[Optional[Path], typer.Option(
        help="TOML file whose 'thresholds' table sets these limits (see configs/compare.toml); options given "
             "here override it.")] = None,
    report_md: Annotated[Optional[Path], typer.Option(
        help="Also write the report as Markdown here; the file $GITHUB_STEP_SUMMARY names is appended to, not "
             "replaced (in GitHub Actions the report is appended there without this too).")] = None,
    report_json: Annotated[Optional[Path], typer.Option(
        help="Also write every figure, per record included, as JSON here.")] = None,
    report_junit: Annotated[Optional[Path], typer.Option(
        help="Also write a JUnit XML file here: one testcase per threshold, failures with their figures (CI test "
             "reports).")] = None,
    report_html: Annotated[Optional[Path], typer.Option(
        help="Also write a self-contained HTML page here (no network needed to view it): the verdict, charts of "
             "the per-token figures, the worst records token by token (hover a token for its top-K), the flips.")
    ] = None,
    max_new_errors: Annotated[Optional[int], typer.Option(
        min=0, help="Fail when more records than this are ok in the baseline and an error in the candidate. "
                    "\\[default: 0]")] = None,
    max_excluded_fraction: Annotated[Optional[float], typer.Option(
        help="Fail when a larger share of records failed on either side (0..1) and so left every figure.")] = None,
    max_broken: Annotated[Optional[int], typer.Option(
        min=0, help="Fail when more positions and records than this hold a broken number: NaN or +-inf, or a "
                    "value on one side only (null = not scored by design is fine).  \\[default: 0]")] = None,
    exact: Annotated[bool, typer.Option(
        help="Fail on any differing bit in the columns both runs hold, and name the first differing record, "
             "column, position and token (see docs/compare.md).")] = False,
    common_records: Annotated[bool, typer.Option(
        "--common-records", metavar="",
        help="Compare only the records present and identical (same tokens, answer, choices) in both files, where "
             "another dataset, missing or edited records would be refused; the report lists those left out and "
             "why.")] = False,
    worst: Annotated[int, typer.Option(min=0, help="How many of the worst records (by KL) to list.")] = 10,
    overwrite: Annotated[bool, typer.Option(
        help="Let a report replace an existing file that is not a report of compare (an earlier report, or an "
             "empty file, is replaced without it).")] = False,
) -> None:
    """Compare two result files (or two eval folders) of the same data; the exit code says whether the thresholds
    hold."""
    try:
        import pyarrow as pa

        from apcscore.compare.ci_outputs import checks_to_cases, github_outputs, to_junit, write_markdown
        from apcscore.compare.gate import compare_files
        from apcscore.compare.thresholds import Thresholds, load_thresholds
        from apcscore.compare.report import render_console, to_json, to_markdown, verdict, write_report
        from apcscore.compare.report_paths import check_report_paths

        check_report_paths({"--report-md": report_md, "--report-json": report_json, "--report-html": report_html,
                            "--report-junit": report_junit},
                           {"baseline file": baseline, "candidate file": candidate, "--config file": config},
                           overwrite)
        thresholds = Thresholds.defaults() if default_gate else Thresholds()
        if config is not None:
            thresholds = thresholds.override(load_thresholds(config))
        thresholds = thresholds.override(Thresholds(
            max_ppl_ratio, max_mean_kld, min_top1_agreement, max_abs_logprob_diff, max_accuracy_drop, max_new_errors,
            max_excluded_fraction, max_broken, significance, decision).given("option"))
        if candidate is None and (baseline.is_dir() or exact):
            raise ApcscoreError("one file alone is compared with the reference it was scored against (score "
                                "--reference-model): give a result file, and a candidate file for --exact")
        if candidate is not None and (baseline.is_dir() or candidate.is_dir()):  # two `apcscore eval` folders
            from apcscore.compare.eval_report import run_eval_compare

            if common_records:
                raise ApcscoreError("--common-records applies to result files (score, perplexity); eval folders "
                                    "must hold the same documents — run both evals with the same tasks and --limit")

            passed = run_eval_compare(baseline, candidate, thresholds, exact, report_md, report_json, report_html,
                                      report_junit, Console())
            raise typer.Exit(0 if passed else 1)
        exact_diff = None
        try:
            if exact:
                from apcscore.compare.gate import add_exact, exact_files

                exact_diff = exact_files(baseline, candidate, common_records)
            result = compare_files(baseline, candidate, thresholds, bootstrap_samples, seed, common_records)
        except (pa.ArrowException, OSError) as e:  # a file damaged past its footer
            raise ApcscoreError(f"cannot read the result files: {e} — write them again") from None
        except ApcscoreError as e:  # not comparable: with --exact, a difference found first is the verdict
            if exact_diff is None or exact_diff.passed:
                raise
            found = "\n".join([exact_diff.summary(), *exact_diff.notes])
            Console().print(f"[bold red]FAIL[/] {escape(found)}\n(no figures: {escape(str(e))})", soft_wrap=True)
            raise typer.Exit(1) from None
        if exact_diff is not None:
            add_exact(result.checks, result.notes, exact_diff)
        render_console(result, Console(), worst)
        if report_md is not None:
            write_markdown(report_md, to_markdown(result, worst))
        if report_json is not None:
            write_report(report_json, to_json(result))
        if report_html is not None:
            write_report(report_html, _html(result, worst))
        if report_junit is not None:
            write_report(report_junit, to_junit(checks_to_cases(result.checks), "apcscore compare"))
        github_outputs(checks_to_cases(result.checks), verdict(result.checks), lambda: to_markdown(result, worst),
                       report_md)
    except ApcscoreError as e:
        Console(stderr=True).print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        if os.environ.get("GITHUB_ACTIONS") == "true":  # the usage error as an annotation on the run
            from apcscore.compare.ci_outputs import annotation

            print(annotation("error", "apcscore compare: nothing compared (exit 2)", str(e)))
        raise typer.Exit(2) from None
    raise typer.Exit(0 if result.passed else 1)


def _html(result: "Comparison", worst: int) -> str:
    """The HTML report, its tokens read with the baseline run's tokenizer (ids when it cannot be loaded)."""
    try:
        from apcscore.compare.html_report import to_html
    except ImportError as e:  # plotly is a dependency; an environment installed before it was added lacks it
        raise ApcscoreError(f"--report-html needs plotly ({e}): pip install 'plotly>=6,<8'") from None
    from apcscore.io.token_text import texts_for
    from apcscore.models.loading import try_load_tokenizer

    notes = []
    tokenizer = None
    if result.records and result.aligned is not None and result.aligned.positions is not None:
        tokenizer, why = try_load_tokenizer(result.base.tokenizer)
        if tokenizer is None:
            notes.append(f"tokens are shown as ids: {why}")
    return to_html(result, worst, texts_for(tokenizer), notes)
