"""`apcscore merge OUT SHARD...`: the one merge of `--shard I/N` runs.

Folders are `eval --shard` runs (run/eval.merge_eval runs lm-eval once more with every response read from them,
no weights); anything else goes to the parquet merge of score, generate or perplexity (run/parquet_shards.py),
whose checks name what is not a shard file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from apcscore.errors import count


def merge(out: Path, paths: list[Path], overwrite: bool, echo: Callable[[str], None],
          note: Callable[[str], None]) -> int:
    """Check the shards, write `out`; the exit code. echo: a line of results; note: a line about the run."""
    if paths and all(p.is_dir() for p in paths):
        from apcscore.run.eval import merge_eval

        return merge_eval(out, paths, overwrite, echo, note)
    from apcscore.run.parquet_shards import merge_shards

    path, rows = merge_shards(out, paths, overwrite=overwrite)
    note(f"merged {count(len(paths), 'shard')}: {count(rows, 'row')} -> {path}")
    return 0
