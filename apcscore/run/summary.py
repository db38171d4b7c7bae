"""What a run says at its end: the summary table, the interrupt note and the exit code.

Text from data, paths and exceptions goes through `rich.markup.escape` before Rich prints it. Messages print with
`soft_wrap=True` (no line break of Rich's own: a path in them stays whole).
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from apcscore.errors import count


def print_interrupted(console: Console, rows: int, partial: Path) -> None:
    """The note of an interrupted run: what is saved where, and how to continue."""
    console.print(f"[yellow]interrupted:[/] {count(rows, 'row')} {'is' if rows == 1 else 'are'} saved in "
                  f"{escape(str(partial))}; continue with the "
                  "same command plus --resume", highlight=False, soft_wrap=True)


def exit_code(console: Console, final: Path, rows: int, errors: int) -> int:
    """0, or 1 (said on the console) when every record of the finished file failed."""
    if rows and errors == rows:
        where = "each line's 'error'" if final.suffix.lower() == ".jsonl" else "the 'error' column"
        failed = "its row is an error" if rows == 1 else f"{errors:,} of {rows:,} rows are errors"
        console.print(f"[bold red]error:[/] every record failed ({failed}); see {where} of {escape(str(final))}",
                      highlight=False, soft_wrap=True)
        return 1
    return 0


def print_summary(console: Console, command: str, out: Path, rows: int, errors: int, sessions: int,
                  timings: dict, job_lines: list[tuple[str, str]]) -> None:
    """The end-of-run table: the whole file's rows and figures, every session's timings added up."""
    table = Table(title=f"apcscore {command}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("records", f"{rows:,} written ({rows - errors:,} ok, {errors:,} error)")
    if sessions > 1:
        table.add_row("sessions", f"{sessions} (resumed; figures and timings cover the whole file)")
    for label, value in job_lines:
        table.add_row(escape(label), escape(value))
    pc = timings["prefix_cache"]
    table.add_row("tokens", f"{timings['prompt_tokens']:,} prefilled, {timings['generated_tokens']:,} generated")
    table.add_row("time", f"{timings['run_seconds']:.1f} s run ({timings['tokens_per_second']:,.0f} tok/s), "
                          f"{timings['load_seconds']:.1f} s load")
    table.add_row("prefix cache", _prefix_cache_line(pc, timings["prompt_tokens"]))
    reusable = pc.get("reusable_tokens") or 0
    if pc["queried_tokens"] and reusable:
        table.add_row("exact reuse", f"--exact-reuse would also have served {reusable:,} prefill tokens of "
                                     f"scored requests from the cache")
    if timings["preemptions"]:
        table.add_row("preemptions", str(timings["preemptions"]))
    table.add_row("output", escape(str(out)))
    console.print(table)


def _prefix_cache_line(pc: dict, prompt_tokens: int) -> str:
    """The summary's prefix-cache line: what was served from the cache, or what --exact-reuse would serve."""
    reusable = pc.get("reusable_tokens") or 0
    if pc["queried_tokens"]:
        store = pc.get("score_store_hits") or 0
        return (f"{pc['hit_rate']:.1%} hit ({pc['hit_tokens']:,} of {pc['queried_tokens']:,} prompt tokens served "
                "from the cache)" + (f"; {store:,} scored positions served from the score store" if store else ""))
    if reusable:
        return (f"not read by scoring (full recompute, the default); --exact-reuse would have served {reusable:,} "
                f"of the {prompt_tokens:,} prefill tokens from the cache, with bitwise the same results")
    return "not read (prompt logprobs need full prefills); blocks written for later requests"
