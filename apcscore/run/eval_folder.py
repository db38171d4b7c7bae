"""The files of an `apcscore eval` output folder, and the rules of --overwrite and --resume over them.

`eval_run.json` (what the run was asked: `RUN_KEYS`, the identity, the flat options), the journal
`responses-<id>.jsonl`, then the results (`results.json` last: it marks a run done) or a shard's `shard.json`.
An unfinished folder needs --resume (with matching options) or --overwrite; finished results need --overwrite."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any, Mapping

from apcscore.errors import ApcscoreError
from apcscore.io.identity import short
from apcscore.io.result_tables import write_atomic
from apcscore.options.commands import EvalOptions
from apcscore.lmeval.store import identity_differences, store_files

RUN_FILE = "eval_run.json"
SHARD_FILE = "shard.json"
RESULTS = ("results.json", "requests.parquet", SHARD_FILE)
# the options that decide which requests a run makes and how they are answered: a resumed run must match
RUN_KEYS = ("model", "tasks", "include_path", "num_fewshot", "limit", "apply_chat_template",
            "fewshot_as_multiturn", "system_instruction", "gen_kwargs", "max_length", "seed", "shard", "partition")


def flat_options(opts: EvalOptions) -> dict[str, Any]:
    """The options as flat JSON values (keys as in a --config file): what `EvalOptions.from_values` reads back."""
    own = {f.name: getattr(opts, f.name) for f in fields(opts) if f.name != "engine"}
    values = {**own, **opts.engine.to_dict()}
    return json.loads(json.dumps(values, default=str))


def run_record(opts: EvalOptions, ident: Mapping[str, Any]) -> dict[str, Any]:
    """eval_run.json's content."""
    values = flat_options(opts)
    return {"run": {k: values.get(k) for k in RUN_KEYS}, "identity": dict(ident), "options": values}


def check_out(out: Path, opts: EvalOptions) -> None:
    """Refuse an --out that is a file, finished results without --overwrite, and an unfinished run without
    --resume or --overwrite (before anything loads)."""
    if out.exists() and not out.is_dir():
        raise ApcscoreError(f"--out {out}: exists and is not a directory")
    if not out.is_dir() or opts.overwrite:
        return
    done = [name for name in RESULTS if (out / name).exists()]
    if done:
        raise ApcscoreError(f"--out {out} already holds {done[0]} (a finished run); pass --overwrite or choose "
                            "another folder")
    if ((out / RUN_FILE).exists() or store_files(out)) and not opts.resume:
        raise ApcscoreError(f"--out {out} holds an unfinished run ({RUN_FILE}, responses-*.jsonl); pass --resume "
                            "to continue it, or --overwrite to discard it and start over")


def clear(out: Path) -> None:
    """--overwrite: remove the files of an earlier run in `out` (nothing else)."""
    for path in [out / RUN_FILE, *(out / n for n in RESULTS), *store_files(out), *out.glob("samples_*.jsonl")]:
        if path.is_file():
            path.unlink()


def start(out: Path, record: dict[str, Any], resume: bool) -> bool:
    """Write eval_run.json of a fresh run; with --resume and an unfinished run in `out`, check that it was asked
    the same (RUN_KEYS and the identity) instead. Returns whether a run is resumed."""
    path = out / RUN_FILE
    if resume and path.exists():
        try:
            old = json.loads(path.read_text())
        except ValueError as exc:
            raise ApcscoreError(f"--resume: {path} is not readable JSON ({exc}); rerun with --overwrite") from None
        diffs = [f"{k}: {short(old.get('run', {}).get(k))} vs {short(record['run'][k])}"
                 for k in RUN_KEYS if old.get("run", {}).get(k) != record["run"][k]]
        diffs += identity_differences(old.get("identity") or {}, record["identity"])
        if diffs:
            raise ApcscoreError(f"--resume: the unfinished run in {out} was asked otherwise ({'; '.join(diffs)}); "
                                "run it with its own options, or start afresh: --overwrite, or another --out")
        return True
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (json.dumps(record, indent=2, sort_keys=True) + "\n").encode())
    return False


def read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from `path`, or a clear error naming `what` it should be."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ApcscoreError(f"{path}: not readable as {what} ({exc})") from None
    if not isinstance(value, dict):
        raise ApcscoreError(f"{path}: not {what} (not a JSON object)")
    return value
