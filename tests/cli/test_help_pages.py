"""Every command's --help shows its documented text intact: Typer renders help as Rich markup, where a bracketed
word such as `[lmeval]` in "pip install 'apcscore[lmeval]'" is a tag and vanishes (cli.markup_safe escapes it)."""

from __future__ import annotations

import re

import click
import pytest
import typer
from typer.testing import CliRunner

from apcscore.cli import app, markup_safe

BOX = re.compile(r"[│╭╮╰╯─┃━┏┓┗┛]")


def flat(text: str) -> str:
    """Rendered or documented text without panel borders, its whitespace collapsed (Rich wraps lines)."""
    return " ".join(BOX.sub(" ", text).split())


def documented(text: str) -> str:
    """What the reader must see: the help as written, escapes removed."""
    return flat(text.replace("\\[", "["))


GROUP = typer.main.get_command(app)
COMMANDS = sorted(GROUP.commands)  # type: ignore[attr-defined]


def test_every_command_is_covered() -> None:
    assert {"score", "generate", "perplexity", "eval", "merge", "compare", "lm-eval", "show"} <= set(COMMANDS)


def test_lm_eval_help_is_lm_evals() -> None:
    """`apcscore lm-eval` passes every argument to lm-eval's own CLI, --help too."""
    pytest.importorskip("lm_eval")
    res = CliRunner().invoke(app, ["lm-eval", "--help"], env={"COLUMNS": "100"}, color=False)
    assert res.exit_code == 0, res.output
    assert "Language Model Evaluation Harness" in res.output
    res = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"}, color=False)
    assert "lm-eval" in res.output


@pytest.mark.parametrize("name", [None, *(c for c in COMMANDS if c != "lm-eval")])
def test_help_page_shows_every_documented_text(name: str | None) -> None:
    command: click.Command = GROUP if name is None else GROUP.commands[name]  # type: ignore[attr-defined]
    res = CliRunner().invoke(app, [*([name] if name else []), "--help"], env={"COLUMNS": "100"}, color=False)
    assert res.exit_code == 0, res.output
    page = flat(res.output)
    texts = [command.help or ""] + [p.help for p in command.params if getattr(p, "help", None)]
    assert len(texts) > 1 or name is None
    for text in texts:
        for paragraph in re.split(r"\n\s*\n", text):  # Rich lays out paragraphs on their own
            want = documented(paragraph)
            assert want in page, f"{name} --help lost text:\n{want}\n--- page ---\n{page}"
    if name == "eval":
        assert "pip install 'apcscore[lmeval]'" in page


def test_markup_safe_escapes_each_bracket_once() -> None:
    assert markup_safe("pip install 'apcscore[lmeval]'") == "pip install 'apcscore\\[lmeval]'"
    assert markup_safe("\\[default: 16]") == "\\[default: 16]"
    assert markup_safe(None) is None


def _cut_or_long(text: str, width: int) -> list[str]:
    return [line for line in text.splitlines() if "…" in line or len(line) > width]


@pytest.mark.parametrize("name", [None, *(c for c in COMMANDS if c != "lm-eval")])
def test_help_at_80_columns_cuts_no_option_name_and_no_word(name: str | None) -> None:
    """Issue 52, item 6: at 80 columns (a CI log, a narrow terminal) Typer's tables cut ~20 option names
    (`--min-top1-agreem…`, `--kv-cache-memor…`) and long words of the help (`configs/compare.t…`)."""
    command: click.Command = GROUP if name is None else GROUP.commands[name]  # type: ignore[attr-defined]
    res = CliRunner().invoke(app, [*([name] if name else []), "--help"], env={"COLUMNS": "80"}, color=False)
    assert res.exit_code == 0, res.output
    assert not _cut_or_long(res.output, 80), "\n".join(_cut_or_long(res.output, 80))
    words = set(BOX.sub(" ", res.output).replace(",", " ").split())
    names = [o for p in command.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")]
    assert names or name in (None, "merge")
    missing = [o for o in names if o not in words]
    assert not missing, f"{name} --help at 80 columns lost {missing}:\n{res.output}"
    for text in [command.help or ""] + [p.help for p in command.params if getattr(p, "help", None)]:
        for paragraph in re.split(r"\n\s*\n", text):  # every word of the help, whole (a long one may fold)
            assert documented(paragraph).replace(" ", "") in flat(res.output).replace(" ", "")


def test_help_in_a_log_is_80_columns_and_whole() -> None:
    """`apcscore compare --help` with its output a pipe and no COLUMNS (as in CI: Rich then takes 80)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "TERMINAL_WIDTH", "FORCE_COLOR",
                                                            "GITHUB_ACTIONS")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    done = subprocess.run([sys.executable, "-m", "apcscore", "compare", "--help"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert not _cut_or_long(done.stdout, 80)
    for option in ("--min-top1-agreement", "--max-abs-logprob-diff", "--max-excluded-fraction", "--common-records"):
        assert option in done.stdout.split()


@pytest.mark.parametrize("command", ["score", "generate", "perplexity", "eval"])
def test_every_engine_option_is_on_the_command_line_or_left_out_with_a_reason(command: str) -> None:
    """Each engine setting (an `EngineConfig` field, as its off-flag where it has one) is a parameter of every
    command that runs a model, exactly once, unless the command's `CLI_LEAVES_OUT` names it with the reason. Issue
    54, item 2: eval's parameters spliced `ENGINE_CLI[:7]` and so silently left out --max-logprobs."""
    from dataclasses import fields

    from apcscore.config import EngineConfig
    from apcscore.options.commands import COMMANDS, cli_keys
    from apcscore.options.specs import ENGINE_OPTIONS

    cls = COMMANDS[command]
    keys = [ENGINE_OPTIONS[f.name].negation or f.name for f in fields(EngineConfig)]
    left_out = cls.CLI_LEAVES_OUT
    assert all(reason.strip() for reason in left_out.values()), left_out
    assert set(left_out) <= set(keys), f"{command} leaves out {set(left_out) - set(keys)}, no engine setting"
    for key in keys:
        shown = cli_keys(cls).count(key)
        assert shown == (0 if key in left_out else 1), f"{command}: {key} is {shown} times in its CLI"


def test_eval_help_lists_max_logprobs() -> None:
    """The eval page shows --max-logprobs, the cap its --config file already took (issue 54, item 2)."""
    res = CliRunner().invoke(app, ["eval", "--help"], env={"COLUMNS": "200"}, color=False)
    assert res.exit_code == 0, res.output
    assert "--max-logprobs" in res.output, res.output


def test_eval_takes_max_logprobs_into_its_engine_config(tmp_path) -> None:
    """--max-logprobs reaches eval's EngineConfig: its check refuses -1 before any task or model loads."""
    res = CliRunner().invoke(app, ["eval", "--tasks", "arc_easy", "--max-logprobs", "-1", "--out",
                                   str(tmp_path / "out")], color=False)
    assert res.exit_code == 2, res.output
    assert "--max-logprobs must be >= 0, not -1" in " ".join(res.output.split()), res.output
