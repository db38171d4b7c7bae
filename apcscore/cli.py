"""The `apcscore` command line: thin Typer commands over jobs and the engine.

Option precedence: command line > `--config FILE` (TOML, keys named like the options with underscores)
> built-in defaults. Every user-facing problem is an ApcscoreError, shown as one clear message.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import click
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text
from typer.core import TyperCommand, TyperGroup

from apcscore import __version__
from apcscore.compare.command import compare
from apcscore.errors import ApcscoreError
from apcscore.options.commands import (EvalOptions, GenerateOptions, Options, PerplexityOptions, ScoreOptions,
                                   cli_params)
from apcscore.show.command import show

_UNESCAPED_BRACKET = re.compile(r"(?<!\\)\[")


def markup_safe(text: str | None) -> str | None:
    """`text` with every `[` not yet escaped written `\\[`: Typer renders help as Rich markup, where
    `[lmeval]` is a tag and vanishes."""
    return None if text is None else _UNESCAPED_BRACKET.sub(r"\\[", text)


def _escaping_help(init: Callable[..., None]) -> Callable[..., None]:
    """A command's `init`, then escape its own help and every parameter's (arguments and options)."""
    def escaped(command: click.Command, *args: Any, **kwargs: Any) -> None:
        init(command, *args, **kwargs)
        command.help = markup_safe(command.help)
        command.short_help = markup_safe(command.short_help)
        for param in command.params:
            if getattr(param, "help", None):
                param.help = markup_safe(param.help)  # type: ignore[attr-defined]
    return escaped


def _plain_help_option(get: Callable[..., click.Option | None]) -> Callable[..., click.Option | None]:
    """A command's `get_help_option`, its --help shown with no `<bool>` (a flag)."""
    def plain(command: click.Command, ctx: click.Context) -> click.Option | None:
        option = get(command, ctx)
        if option is not None:
            option.metavar = ""
        return option
    return plain


class _OptionsTable(Table):
    """Typer's options table, laid out so that no option name is cut at 80 columns.

    Typer's rows of six or seven cells (mark, long, short, `--no-x` long and short names, type, help) become (mark,
    names, type, help); only the help column narrows, folding a long word; a `--no-x` form gets a row of its own
    and a type's range (`[x>=100]`) goes at the end of the help."""

    def add_row(self, *cells: Any, **kwargs: Any) -> None:
        if len(cells) < 6:  # not an options row (Typer's commands table sets its own columns)
            super().add_row(*cells, **kwargs)
            return
        mark, (long, short, no_long, no_short, kind, help_) = (cells[0] if len(cells) == 7 else ""), cells[-6:]
        items = list(getattr(help_, "renderables", None) or [help_])  # Typer's Columns: the help, [default: ...]
        if isinstance(kind, Text) and " [" in kind.plain:  # `<int range> [x>=100]`: the range after the help
            at = kind.plain.index(" [")
            kind, items = kind[:at], [*items, kind[at + 1:]]
        if all(isinstance(t, Text) for t in items):  # one Text, which folds a long word (Columns' cells cut it)
            help_ = Text("\n").join(items)
            help_.overflow = "fold"
        if not self.columns:
            for _ in range(3):
                self.add_column(no_wrap=True)
            self.add_column(overflow="fold", ratio=1)
        super().add_row(mark, Text.assemble(long, " " if str(short) else "", short), kind, help_, **kwargs)
        if str(no_long) or str(no_short):
            super().add_row("", Text.assemble(no_long, " " if str(no_short) else "", no_short), "", "", **kwargs)


def _fitting_help(format_help: Callable[..., None]) -> Callable[..., None]:
    """A command's `format_help`, Typer's tables being `_OptionsTable`s while it renders (typer.rich_utils looks
    `Table` up when it draws a panel)."""
    def fitted(command: click.Command, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        import typer.rich_utils

        table = typer.rich_utils.Table
        typer.rich_utils.Table = _OptionsTable
        try:
            format_help(command, ctx, formatter)
        finally:
            typer.rich_utils.Table = table
    return fitted


class Group(TyperGroup):
    """Typer's group; its --help shows no `<bool>`; help text is never read as markup."""

    __init__ = _escaping_help(TyperGroup.__init__)
    format_help = _fitting_help(TyperGroup.format_help)
    get_help_option = _plain_help_option(TyperGroup.get_help_option)


class Command(TyperCommand):
    """Typer's command with a plain usage line: `DATASET`, not `{dataset}`; help text is never read as markup."""

    __init__ = _escaping_help(TyperCommand.__init__)
    format_help = _fitting_help(TyperCommand.format_help)
    get_help_option = _plain_help_option(TyperCommand.get_help_option)

    def collect_usage_pieces(self, ctx: click.Context) -> list[str]:
        pieces = super().collect_usage_pieces(ctx)
        return [p[1:p.index("}")].upper() + p[p.index("}") + 1:] if p.startswith("{") and "}" in p else p
                for p in pieces]


app = typer.Typer(help="Batch scoring and evaluation of causal language models (paged KV cache, prefix caching).",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False, cls=Group)
# Messages print with soft_wrap=True: Rich then breaks no line of its own, so a path in a message stays whole
# (copyable from a log) at any terminal width; tables print without it.
console = Console(stderr=True)
out_console = Console()


# ---- parameters ---------------------------------------------------------------------------------
DatasetArg = Annotated[Path, typer.Argument(
    help="Dataset: JSONL (one record per line), parquet, CSV, or a datasets save_to_disk directory.",
    metavar="DATASET", show_default=False)]
ConfigOpt = Annotated[Optional[Path], typer.Option("--config", help="TOML file of option values (see configs/).")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace an existing output file.",
                                            metavar="")]  # a flag: no `<bool>` in the help


def _param(name: str, annotation: Any, default: Any = inspect.Parameter.empty) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


def takes(options: type[Options], *first: inspect.Parameter,
          **extra: inspect.Parameter) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command function `fn(**params)` the parameters `first` (the dataset), then those of an options
    class (options/commands.py) in its --help order, each in its panel, with `extra` (--config), the parameters
    no option declares, where that order names them."""
    params = list(first)
    for p in cli_params(options):
        if isinstance(p, str):
            params.append(extra[p])
            continue
        kind = p.type if p.default is False else Optional[p.type]
        option = typer.Option(*p.flags, help=p.help, rich_help_panel=p.panel, **p.typer)
        params.append(_param(p.name, Annotated[kind, option], p.default))

    def give(fn: Callable[..., None]) -> Callable[..., None]:
        fn.__signature__ = inspect.Signature(params, return_annotation=None)  # type: ignore[attr-defined]
        fn.__annotations__ = {p.name: p.annotation for p in params}
        return fn
    return give


DATASET = _param("dataset", DatasetArg)
CONFIG = _param("config", ConfigOpt, None)


@contextmanager
def _exit_on_errors() -> Iterator[None]:
    """An ApcscoreError raised in the block ends the command with its message (escaped: it may quote data, paths or
    exceptions) and exit code (a context, not a wrapper: the command's call stays one frame from the command)."""
    try:
        yield
    except ApcscoreError as exc:
        console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(exc.exit_code) from None


def _exit(code: int) -> None:
    """End the command with `code` where it is nonzero."""
    if code:
        raise typer.Exit(code)


def _plain(to: Console) -> Callable[[str], None]:
    """Print a line as it is (no markup, no highlighting, no wrapping of our own) on `to`."""
    return lambda text: to.print(text, markup=False, highlight=False, soft_wrap=True)


# ---- commands -----------------------------------------------------------------------------------
def _run(command: str, params: dict[str, Any]) -> None:
    """Run a command from its parameters (those of the command function)."""
    from apcscore.run.driver import run_command

    options = {k: v for k, v in params.items() if k not in ("dataset", "config")}
    with _exit_on_errors():
        _exit(run_command(command, params["dataset"], options, params["config"], console))


@app.command(cls=Command)
@takes(ScoreOptions, DATASET, config=CONFIG)
def score(**params: Any) -> None:
    """Per-token prompt logprobs (own logprob, rank, top-K) and per-record NLL / perplexity; loglikelihoods.

    Records: {"id"?, "prompt": str}, {"id"?, "prompt_token_ids": \\[int, ...]},
    {"id"?, "context": str, "continuation": str} (loglikelihood, is_greedy), or
    {"id"?, "context": str, "choices": \\[str, ...], "answer": int} (multiple choice: pred, correct).
    Or OpenAI Batch request lines: /v1/completions with "echo": true and "max_tokens": 0 scores the prompt.
    """
    _run("score", params)


@app.command(cls=Command)
@takes(GenerateOptions, DATASET, config=CONFIG)
def generate(**params: Any) -> None:
    """Completions with sampling options; prompts sharing a prefix reuse its cached KV.

    Records: {"id"?, "prompt": str}, {"id"?, "prompt_token_ids": \\[int, ...]} or
    {"id"?, "messages": \\[{"role", "content"}, ...]} (chat template with generation prompt),
    optionally with per-record values of the Sampling options (as keys with underscores: max_tokens, top_p, ...).
    Or OpenAI Batch request lines (/v1/chat/completions, /v1/completions); --out X.jsonl writes result lines.
    """
    _run("generate", params)


@app.command(cls=Command)
@takes(PerplexityOptions, DATASET, config=CONFIG)
def perplexity(**params: Any) -> None:
    """Perplexity of long texts with rolling windows: token, word and byte perplexity, bits per byte.

    Records: {"id"?, "text": str}. The sequence [BOS (or EOS)] + tokens(text) is cut into windows of
    --window tokens of context advancing by --stride; every text token is scored exactly once
    (--stride = --window is lm-eval's rolling loglikelihood).
    """
    _run("perplexity", params)


@app.command("eval", cls=Command)
@takes(EvalOptions, config=CONFIG)
def eval_(**params: Any) -> None:
    """Run lm-evaluation-harness tasks with apcscore's engine as the model (lm-eval's `--model apcscore`).

    Writes lm-eval's results JSON and a per-request parquet to --out and prints lm-eval's table. Needs the
    `lmeval` extra (pip install 'apcscore[lmeval]').
    """
    from apcscore.run.eval import run_eval

    with _exit_on_errors():
        _exit(run_eval(params, _plain(out_console), _plain(console)))


@app.command("lm-eval", cls=Command, add_help_option=False,
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def lm_eval_(ctx: typer.Context) -> None:
    """lm-eval's own command line with the model "apcscore" registered: every argument goes to lm-eval untouched
    (`apcscore lm-eval --model apcscore --model_args pretrained=smollm2-135m --tasks T ...`; `apcscore lm-eval
    --help` is lm-eval's help). The same as `python -m apcscore.lmeval`. Needs the `lmeval` extra."""
    import importlib.util

    with _exit_on_errors():
        if importlib.util.find_spec("lm_eval") is None:
            raise ApcscoreError("apcscore lm-eval needs lm-eval: pip install 'apcscore[lmeval]'")
    from apcscore.lmeval.__main__ import main as lm_eval_main

    lm_eval_main(list(ctx.args))


@app.command(cls=Command)
def merge(
    out: Annotated[Path, typer.Argument(help="The merged parquet file (of eval shards: the output folder).",
                                        metavar="OUT", show_default=False)],
    shards: Annotated[list[Path], typer.Argument(help="The shard files (eval: folders) of one --shard 0/N .. "
                                                 "N-1/N run.", metavar="SHARD", show_default=False)],
    overwrite: OverwriteOpt = False,
) -> None:
    """Join the files of `--shard I/N` runs into the file one run would have written (checks they are the shards
    of one dataset under one configuration, refuses gaps and overlaps). The folders of `eval --shard I/N` runs
    are joined into the folder one eval would have written (no model weights are loaded)."""
    from apcscore.run.merge import merge as merge_any

    with _exit_on_errors():
        _exit(merge_any(out, shards, overwrite, _plain(out_console), _plain(console)))


app.command("compare", cls=Command)(compare)  # lives in its own module; needs no model
app.command("show", cls=Command)(show)  # one record of a result file, token by token; needs no model


def version_callback(value: bool) -> None:
    if value:
        out_console.print(f"apcscore {__version__}")
        raise typer.Exit()


@app.callback()
def main_callback(
    version: Annotated[bool, typer.Option("--version", callback=version_callback, is_eager=True, metavar="",
                                          help="Show the version and exit.")] = False,
) -> None:
    """apcscore: score, evaluate and generate with causal language models in one batch engine."""


def main() -> None:
    app()
