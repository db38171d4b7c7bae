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
