"""`apcscore merge OUT SHARD...`: the one merge of `--shard I/N` runs, with an adapter per output format.

- `ParquetShards`: the shard files of score, generate or perplexity (run/parquet_shards.py: checks, then the rows in
  dataset order);
- `EvalShardFolders`: the shard folders of eval (run/eval_shards.py checks them; run/eval.merge_eval runs lm-eval
  once more with every response read from them, no weights).

An adapter says which shards it takes (`takes`); the first that takes them merges. A mix of files and folders
goes to the parquet adapter, whose check names it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol

from apcscore.errors import count

Say = Callable[[str], None]


class MergeFormat(Protocol):
    """One output format's merge."""

    def takes(self, paths: list[Path]) -> bool:
        """Whether `paths` are shards of this format."""

    def merge(self, out: Path, paths: list[Path], overwrite: bool, echo: Say, note: Say) -> int:
        """Check the shards, write `out`; the exit code. echo: a line of results; note: a line about the run."""


class EvalShardFolders:
    """The folders of `eval --shard I/N` runs -> the folder one eval would have written."""

    def takes(self, paths: list[Path]) -> bool:
        return bool(paths) and all(p.is_dir() for p in paths)

    def merge(self, out: Path, paths: list[Path], overwrite: bool, echo: Say, note: Say) -> int:
        from apcscore.run.eval import merge_eval

        return merge_eval(out, paths, overwrite, echo, note)


class ParquetShards:
    """The parquet shard files of score, generate or perplexity -> the file one run would have written."""

    def takes(self, paths: list[Path]) -> bool:
        return True  # everything else: its checks name what is not a shard file

    def merge(self, out: Path, paths: list[Path], overwrite: bool, echo: Say, note: Say) -> int:
        from apcscore.run.parquet_shards import merge_shards

        path, rows = merge_shards(out, paths, overwrite=overwrite)
        note(f"merged {count(len(paths), 'shard')}: {count(rows, 'row')} -> {path}")
        return 0


FORMATS: tuple[MergeFormat, ...] = (EvalShardFolders(), ParquetShards())


def merge(out: Path, paths: list[Path], overwrite: bool, echo: Say, note: Say) -> int:
    """`apcscore merge`: the first format that takes `paths` merges them; the exit code."""
    chosen = next(f for f in FORMATS if f.takes(paths))
    return chosen.merge(out, paths, overwrite, echo, note)
