"""Progress of a run (issue 52, item 8): an ETA on the terminal's bar, and plain periodic lines where the output is
not a terminal (a CI log), where the bar used to be switched off and a long run printed nothing until its end."""

from __future__ import annotations

import io
import re

from rich.console import Console
from rich.progress import Progress, TimeRemainingColumn
from typer.testing import CliRunner

from apcscore.run import progress as progress_module
from apcscore.run.progress import MAX_SECONDS, MIN_SECONDS, PlainProgress, make_progress


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _plain(total: int) -> tuple[PlainProgress, Clock, io.StringIO]:
    out = io.StringIO()
    clock = Clock()
    p = PlainProgress(Console(file=out, width=80), clock)
    p.add_task("score", total=total, tok_s=0.0, hit=0.0, kv="0/0")
    return p, clock, out


def test_plain_lines_every_5_percent_but_not_closer_than_10_s_and_with_an_eta() -> None:
    p, clock, out = _plain(1000)
    with p:
        for i in range(1000):  # one record per 0.5 s: 5% (50 records) every 25 s
            clock.now += 0.5
            p.update(0, advance=1, tok_s=1234.4, hit=0.25, kv="12/3518")
    lines = out.getvalue().splitlines()
    assert len(lines) == 20  # one per 5%, the last at 100%
    assert lines[0] == ("score: 50/1,000 records (5%), 0:00:25 elapsed, ETA 0:07:55, 1,234 tok/s, prefix hit 25%, "
                        "KV 12/3518")  # 25 s for 50 records: 950 left take 475 s
    assert lines[-1].startswith("score: 1,000/1,000 records (100%), 0:08:20 elapsed, ETA 0:00:00")


def test_plain_lines_are_at_most_one_per_10_s_and_at_least_one_per_minute() -> None:
    p, clock, out = _plain(10)  # 10% per record: every record is a step
    for _ in range(10):  # fast records: 1 s each
        clock.now += 1
        p.update(0, advance=1)
    assert len(out.getvalue().splitlines()) == 1  # 10 s: one line
    p, clock, out = _plain(1000)
    for _ in range(20):  # a long record: nothing finishes for 20 x 10 s, the engine ticks
        clock.now += 10
        p.update(0, tok_s=50.0)
    lines = out.getvalue().splitlines()
    assert len(lines) == 200 // MAX_SECONDS  # a heartbeat per minute
    assert lines[0].startswith("score: 0/1,000 records (0%), 0:01:00 elapsed, ETA -, 50 tok/s")


def test_a_short_run_prints_no_line_and_a_long_one_ends_with_its_last() -> None:
    p, clock, out = _plain(100)
    with p:
        clock.now += MIN_SECONDS / 2
        p.update(0, advance=100)
    assert out.getvalue() == ""
    p, clock, out = _plain(100)
    with p:
        clock.now += MIN_SECONDS
        p.update(0, advance=7)
        clock.now += 1
        p.update(0, advance=2)  # under 10 s since the last line: none
    lines = out.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == ["score: 7/100 records (7%)", "score: 9/100 records (9%)"]


def test_make_progress_picks_a_bar_with_an_eta_on_a_terminal_and_lines_in_a_log() -> None:
    terminal = Console(file=io.StringIO(), force_terminal=True)
    bar = make_progress(terminal, quiet=False)
    assert isinstance(bar, Progress) and not bar.disable
    assert any(isinstance(c, TimeRemainingColumn) for c in bar.columns)
    assert isinstance(make_progress(Console(file=io.StringIO()), quiet=False), PlainProgress)
    assert make_progress(terminal, quiet=True).disable and make_progress(Console(file=io.StringIO()), True).disable


def test_score_prints_plain_progress_lines_in_a_log(tmp_path, write_jsonl, tiny, monkeypatch) -> None:
    """The real command, its stderr not a terminal (CliRunner): lines with the ETA, then the summary."""
    from apcscore.cli import app

    monkeypatch.setattr(progress_module, "MIN_SECONDS", 0.0)  # a line per 5% of the records, however fast
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": str(i), "prompt": f"Hello number {i}"} for i in range(40)])
    res = CliRunner().invoke(app, ["score", str(data), "--model", tiny, "--out", str(tmp_path / "o.parquet")],
                             env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    lines = [line for line in res.stderr.splitlines() if line.startswith("score: ")]
    assert len(lines) == 20, res.stderr  # 2 of 40 records each
    assert re.fullmatch(r"score: 2/40 records \(5%\), \d:\d\d:\d\d elapsed, ETA \d:\d\d:\d\d, [\d,]+ tok/s, prefix "
                        r"hit \d+%, KV \d+/\d+", lines[0]), lines[0]
    assert lines[-1].startswith("score: 40/40 records (100%)")
