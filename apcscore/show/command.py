"""`apcscore show RESULTS.parquet [--id ID] [--position N]`: one record of a result file in the terminal, its
tokens coloured by their logprob; for a chosen position its rank and top-K.

The prompt's tokens, else (or with `--completion`) a generate run's completion; without `--id`, the first record
with per-token logprobs. Token texts come from the run's tokenizer (or `--tokenizer`), else ids; a character that
a byte-level tokenizer split is shown whole (io/token_text.py). Heavy imports happen when the command runs."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.markup import escape

from apcscore.errors import ApcscoreError, count

# (lowest logprob of the band, Rich style, legend) from the most to the least likely; the 16 standard colours,
# which every colour terminal shows as distinct
_BANDS = ((-1.0, "black on green", ">= -1"), (-3.0, "black on yellow", "-3 to -1"),
          (-6.0, "black on bright_red", "-6 to -3"), (-math.inf, "bright_white on red", "< -6"))
_UNSCORED = "dim"
_LOWEST = 5  # positions listed when no --position is given

_PROMPT = ("token_ids", "token_logprobs", "token_ranks", "top_ids", "top_logprobs")
_COMPLETION = ("completion_token_ids", "completion_logprobs", "completion_ranks", "completion_top_ids",
               "completion_top_logprobs")
_SUMMARY = ("status", "error", "num_tokens", "mean_nll", "perplexity", "finish_reason")
_HOW_TO_GET = {"score": "score with --prompt-logprobs K (K >= 0 stores each token's logprob and rank)",
               "perplexity": "run perplexity with --prompt-logprobs K",
               "generate": "generate with --logprobs K (the completion) or --prompt-logprobs K (the prompt)"}


@dataclass
class Tokens:
    """One record's per-token columns of one kind ("prompt" or "completion"), aligned by position."""

    kind: str
    ids: list[int]
    logprobs: list[float | None]
    ranks: list[int | None] | None
    top_ids: list[list[int] | None] | None
    top_logprobs: list[list[float] | None] | None


def _open(path: Path) -> tuple[Any, dict[str, Any]]:
    """The parquet file and its run metadata, or a clear error."""
    from apcscore.io.result_tables import open_result_file

    pf, meta = open_result_file(path, str(path), "show", "apcscore score, perplexity or generate")
    if meta.get("command") == "eval":
        raise ApcscoreError(f"{path} holds the requests of an `apcscore eval` run (one row per lm-eval request, no "
                            "per-token logprobs); show reads files written by apcscore score, perplexity or generate")
    if "id" not in pf.schema_arrow.names:
        raise ApcscoreError(f"{path} is not apcscore output (no id column); show "
                            "reads files written by apcscore score, perplexity or generate")
    return pf, meta


def _columns(pf: Any, meta: dict[str, Any], path: Path, completion: bool) -> tuple[str, ...]:
    """The per-token columns to show: the prompt's, else (or with --completion) the completion's."""
    names = set(pf.schema_arrow.names)
    has_prompt, has_completion = _PROMPT[1] in names, _COMPLETION[1] in names
    if completion and not has_completion:
        raise ApcscoreError(f"--completion: {path} has no completion logprobs (completion_logprobs); they are "
                            "written by apcscore generate --logprobs K")
    if not (has_prompt or has_completion):
        command = meta.get("command") or "?"
        how = _HOW_TO_GET.get(command, "score with --prompt-logprobs K")
        raise ApcscoreError(f"{path} has no per-token logprobs (written by `apcscore {command}` without them): "
                            f"{how}")
    return _COMPLETION if completion or not has_prompt else _PROMPT


def _read_row(pf: Any, path: Path, record_id: str | None, cols: tuple[str, ...]) -> tuple[dict[str, Any], int]:
    """The record's row (its id, summary and per-token columns) and its index in the file. Without an id: the first
    row with a scored position (a per-token logprob that is not null)."""
    import pyarrow.compute as pc

    names = set(pf.schema_arrow.names)
    wanted = ["id", *(c for c in _SUMMARY if c in names), *(c for c in cols if c in names)]
    starts = list(accumulate((pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)), initial=0))
    if record_id is not None:
        ids = pc.cast(pf.read(columns=["id"])["id"], "string")
        index = pc.index(ids, record_id).as_py()
        if index < 0:
            sample = ", ".join(repr(x) for x in ids.slice(0, 5).to_pylist())
            more = f" and {len(ids) - 5} more" if len(ids) > 5 else ""
            raise ApcscoreError(f"no record with id {record_id!r} in {path} ({count(len(ids), 'record')}: "
                                f"{sample}{more})")
        group = next(g for g in range(pf.num_row_groups) if starts[g + 1] > index)
        row = pf.read_row_group(group, columns=wanted).slice(index - starts[group], 1).to_pylist()[0]
        return row, index
    for g in range(pf.num_row_groups):
        lps = pf.read_row_group(g, columns=[cols[1]])[cols[1]].combine_chunks()  # [rows] lists of logprobs
        scored = pc.list_parent_indices(lps).to_numpy()[pc.is_valid(pc.list_flatten(lps)).to_numpy(
            zero_copy_only=False)]  # the row of every scored position, ascending (a one-token prompt has none)
        if len(scored):
            first = int(scored[0])
            return pf.read_row_group(g, columns=wanted).slice(first, 1).to_pylist()[0], starts[g] + first
    raise ApcscoreError(f"no record of {path} has per-token logprobs ({cols[1]} is null in every row: error rows, or "
                        "continuation / multiple-choice records, which store per-record figures only)")


def _tokens(row: dict[str, Any], cols: tuple[str, ...]) -> Tokens:
    ids, lps, ranks, top_ids, top_lps = (row.get(c) for c in cols)
    if ids is None or lps is None:
        why = (f"its status is error: {row.get('error') or 'no message'}" if row.get("status") == "error" else
               "a continuation or multiple-choice record stores per-record figures only")
        raise ApcscoreError(f"record {str(row['id'])!r} has no per-token logprobs ({why}); choose another with --id")
    return Tokens("prompt" if cols is _PROMPT else "completion", ids, lps, ranks, top_ids, top_lps)


def _style(lp: float | None) -> str:
    if lp is None:
        return _UNSCORED
    return next(style for low, style, _ in _BANDS if lp >= low)


def _visible(text: str) -> str:
    return text.replace("\n", "↵\n") if text else "∅"


def _check_position(t: Tokens, rid: str, position: int) -> None:
    n = len(t.ids)
    if not 0 <= position < n:
        raise ApcscoreError(f"--position {position} is out of range: record {rid!r} has {n} {t.kind} tokens "
                            f"(positions 0 to {n - 1})")
    if t.logprobs[position] is None:
        first = "the first prompt token has no context, so no logprob" if position == 0 and t.kind == "prompt" \
            else "this position was not scored"
        scored = [i for i, lp in enumerate(t.logprobs) if lp is not None]
        span = f"; choose {scored[0]} to {scored[-1]}" if scored else ""
        raise ApcscoreError(f"--position {position}: {first}{span}")


def render(console: Console, path: Path, row: dict[str, Any], index: int, num_rows: int, t: Tokens,
           texts: Any, picked: bool, position: int | None) -> None:
    """Print the record's text coloured by logprob (`texts`: token_text.Texts; a character split across tokens is
    one span), then the chosen position's top-K (or the least likely positions)."""
    from rich.table import Table
    from rich.text import Text

    rid = str(row["id"])
    tt = texts(t.ids)
    facts = [f"{len(t.ids)} {t.kind} tokens"]
    if t.kind == "prompt" and row.get("mean_nll") is not None:
        facts.append(f"mean NLL {row['mean_nll']:.4f}, perplexity {row['perplexity']:.6g}")
    if t.kind == "completion" and row.get("finish_reason"):
        facts.append(f"finish reason {row['finish_reason']}")
    how = " — the first record with per-token logprobs; pick another with --id" if picked else ""
    console.print(f"[bold]{escape(str(path))}[/]: record [bold]{escape(repr(rid))}[/] (row {index + 1} of "
                  f"{num_rows}{escape(how)}), {escape(', '.join(facts))}", highlight=False)
    text = Text()
    for start, stop, span in tt.spans:  # a character split across tokens is one span, in its least likely colour
        scored = [lp for lp in t.logprobs[start:stop] if lp is not None]
        style = _style(min(scored) if scored else None)
        if position is not None and start <= position < stop:
            style += " bold underline"
        text.append(_visible(span), style=style)
    console.print(text)
    legend = Text("logprob: ")
    for _, style, label in _BANDS:
        legend.append(f" {label} ", style=style).append(" ")
    legend.append(" not scored ", style=_UNSCORED)
    console.print(legend)

    def token(i: int) -> str:  # its own text; a part of a character also names the character
        start, stop, span = tt.span_of(i)
        own = json.dumps(tt.pieces[i], ensure_ascii=False)
        return own if stop - start == 1 else f"{own} (part of {json.dumps(span, ensure_ascii=False)})"

    if position is None:
        scored = sorted((lp, i) for i, lp in enumerate(t.logprobs) if lp is not None)[:_LOWEST]
        if not scored:
            console.print("no position of this record is scored (a first token has no logprob: nothing comes "
                          "before it)", highlight=False)
            return
        table = Table("position", "token", "id", "logprob", "rank", title=f"The {len(scored)} least likely tokens "
                      "(--position N shows a position's top-K)", title_justify="left")
        for lp, i in scored:
            rank = t.ranks[i] if t.ranks is not None and t.ranks[i] is not None else "-"
            table.add_row(str(i), escape(token(i)), str(t.ids[i]), f"{lp:.4f}", str(rank))
        console.print(table)
        return
    rank = t.ranks[position] if t.ranks is not None and t.ranks[position] is not None else "-"
    console.print(f"position {position}: {escape(token(position))} (id {t.ids[position]}), logprob "
                  f"{t.logprobs[position]:.4f}, rank {rank}", highlight=False)
    top_ids = t.top_ids[position] if t.top_ids is not None else None
    if not top_ids:
        console.print("no top-K stored at this position (the run's K was 0)", highlight=False)
        return
    top_lps = t.top_logprobs[position]
    alt = [texts([i]).pieces[0] for i in top_ids]  # alone: a partial character shows its bytes (<0xE8>)
    table = Table("", "token", "id", "logprob", title=f"top-{len(top_ids)} at position {position}",
                  title_justify="left")
    for k, (tid, lp, piece) in enumerate(zip(top_ids, top_lps, alt), 1):
        mine = tid == t.ids[position]
        table.add_row(str(k), escape(json.dumps(piece, ensure_ascii=False)), str(tid), f"{lp:.4f}",
                      style="bold" if mine else None)
    console.print(table)
    if t.ids[position] not in top_ids:
        console.print(f"the actual token is not in the top-{len(top_ids)} (rank {rank})", highlight=False)


def show(
    results: Annotated[Path, typer.Argument(help="A result file of apcscore score, perplexity or generate.",
                                            metavar="RESULTS", show_default=False)],
    record_id: Annotated[Optional[str], typer.Option(
        "--id", help="The record to show (default: the first record with per-token logprobs).")] = None,
    position: Annotated[Optional[int], typer.Option(
        help="A token position (0 = the first token) whose rank and top-K to show.")] = None,
    completion: Annotated[bool, typer.Option(
        "--completion", help="Show the completion's tokens (generate --logprobs) where the file also has the "
                             "prompt's.", metavar="")] = False,
    tokenizer: Annotated[Optional[Path], typer.Option(
        help="Tokenizer folder for the token texts (default: the one the run metadata names).")] = None,
) -> None:
    """One record of a result file: its tokens coloured by logprob and, for a position, its rank and top-K."""
    err = Console(stderr=True)
    try:
        from apcscore.io.token_text import texts_for, tokenizer_path
        from apcscore.models.loading import try_load_tokenizer

        pf, meta = _open(results)
        cols = _columns(pf, meta, results, completion)
        row, index = _read_row(pf, results, record_id, cols)
        t = _tokens(row, cols)
        if position is not None:
            _check_position(t, str(row["id"]), position)
        if tokenizer is not None and tokenizer.is_file():
            raise ApcscoreError(f"--tokenizer {tokenizer} is a file — give the tokenizer's folder (a model directory "
                                "holding tokenizer.json and tokenizer_config.json)")
        tok, why = try_load_tokenizer(tokenizer if tokenizer is not None else tokenizer_path(meta))
        if tok is None and tokenizer is not None:
            raise ApcscoreError(f"--tokenizer {tokenizer}: {why}")
        if tok is None:
            err.print(f"[yellow]note:[/] tokens are shown as ids: {escape(why or '')} (pass --tokenizer DIR)",
                      highlight=False, soft_wrap=True)
        render(Console(), results, row, index, pf.metadata.num_rows, t, texts_for(tok), record_id is None, position)
    except ApcscoreError as e:
        err.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(e.exit_code) from None
