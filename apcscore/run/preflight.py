"""Checks that run before the model's weights load: where the output goes (`check_output`, `check_file_path`) and
what the model can take (`check_against_model`: token ids outside the vocabulary, prompts without tokens, top-K
above the vocabulary)."""

from __future__ import annotations

import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from apcscore.errors import ApcscoreError, shown
from apcscore.io.reader import LoadedDataset, listed_problems
from apcscore.io.schemas import InvalidRecord
from apcscore.options.commands import GenerateOptions, RunOptions


def default_out(dataset: Path, command: str, suffix: str = ".parquet", shard: str | None = None) -> Path:
    """results/<dataset stem>.<command>.parquet (or `suffix`); a `--shard I/N` run's file names its shard
    (<stem>.<command>.shard-I-of-N.parquet), so the shards of one dataset do not take each other's file."""
    index, _, count = (shard or "").partition("/")
    part = f".shard-{index.strip()}-of-{count.strip()}" if shard else ""
    return Path("results") / f"{dataset.stem}.{command}{part}{suffix}"


# --out suffixes that name a format apcscore reads as a dataset or a compressed file: a parquet file under such a
# name is refused (other names, e.g. .out, get a note)
_OTHER_FORMATS = {".csv": "CSV", ".tsv": "tab-separated text", ".json": "JSON", ".jsonl": "JSON lines",
                  ".ndjson": "JSON lines", ".txt": "text", ".gz": "gzip-compressed data",
                  ".bz2": "bzip2-compressed data", ".xz": "xz-compressed data", ".zst": "zstd-compressed data",
                  ".zip": "a zip archive"}


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def check_output(out_option: str | None, dataset: Path, command: str, *, overwrite: bool,
                 resume: bool, suffix: str = ".parquet", shard: str | None = None) -> tuple[Path, str | None]:
    """The output path, and a warning to show (or None); raise ApcscoreError when it cannot be written (empty, `-`, the
    dataset, a directory, not writable, existing without --overwrite, `--resume` of a finished run)."""
    if out_option is not None and not out_option.strip():
        raise ApcscoreError("--out is empty — give a file name such as results/out.parquet, or leave --out out for "
                            f"the default {default_out(dataset, command)}")
    if out_option == "-":
        raise ApcscoreError("--out -: results cannot go to standard output (a parquet file needs a seekable file) "
                            "— give a file name such as results/out.parquet")
    out = Path(out_option) if out_option is not None else default_out(dataset, command, suffix, shard)
    if _same_file(out, dataset):
        raise ApcscoreError(f"--out {out} is the dataset itself; writing results there would replace the data — "
                            "choose another --out")
    check_file_path(out)
    partial = out.with_name(out.name + ".partial")
    warning = None
    if out.exists() and not overwrite:
        if resume and not partial.exists():
            raise ApcscoreError(f"{out} is a finished run (there is no {partial.name} to resume) — pass --overwrite "
                                "to run it again, or choose another --out")
        if not resume:
            raise ApcscoreError(f"{out} exists — pass --overwrite to replace it, or choose another --out")
    check_out_format(out, "--out", "the results are", suffix)
    if resume and not partial.exists():
        warning = f"nothing to resume: {partial} does not exist; starting a fresh run"
    elif out.suffix.lower() not in (".parquet", ".pq", suffix):
        warning = (f"--out {out}: the results are written as {suffix.lstrip('.')} whatever the file's name says "
                   f"(name it {out.with_suffix(suffix).name} to say so)")
    return out, warning


def check_out_format(out: Path, what: str, written: str, suffix: str = ".parquet") -> None:
    """Refuse an output `out` (named by `what`) whose suffix names a data format apcscore reads (.csv, .jsonl.gz,
    ...) other than the `suffix` it is written as: read back as a dataset, such a file would not decode."""
    other = _OTHER_FORMATS.get(out.suffix.lower())
    if other is not None and out.suffix.lower() != suffix:
        raise ApcscoreError(f"{what} {out}: {written} written as {suffix.lstrip('.')}, and a {out.suffix} name "
                            f"says {other} (read back as a dataset, the file would not decode) — name it "
                            f"{out.with_suffix(suffix).name}")


def check_errors_out(option: str, out: Path, dataset: Path, *, overwrite: bool) -> Path:
    """The `--errors-out` path (OpenAI Batch error lines): a writable file path that is neither the dataset nor
    `out`, and that does not exist unless --overwrite."""
    path = Path(option)
    if not option.strip() or option == "-":
        raise ApcscoreError(f"--errors-out {option!r} is not a file name — give one such as results/errors.jsonl")
    for other, what in ((dataset, "the dataset itself"), (out, "--out itself")):
        if _same_file(path, other):
            raise ApcscoreError(f"--errors-out {path} is {what}; the error lines need a file of their own — choose "
                                "another --errors-out")
    if path.is_dir():
        raise ApcscoreError(f"--errors-out {path} is a directory — give a file name such as {path / 'errors.jsonl'}")
    if path.exists() and not overwrite:
        raise ApcscoreError(f"--errors-out {path} exists — pass --overwrite to replace it, or choose another "
                            "--errors-out")
    check_file_path(path, "--errors-out")
    return path


def check_file_path(out: Path, what: str = "--out") -> None:
    """`out` (the option or argument `what` names) must be a file path in a folder that can be written: not a
    directory, not under a file, not in a read-only or pseudo file system (the missing folders are created)."""
    if out.is_dir():
        raise ApcscoreError(f"{what} {out} is a directory — give a file name such as {out / 'results.parquet'}")
    folder = out.absolute().parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise ApcscoreError(f"{what} {out}: {folder} is a file, not a folder — choose another {what}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ApcscoreError(f"{what} {out}: the folder {folder} is not writable — choose another {what}, "
                            "or fix the folder's permissions")
    try:  # what permissions do not say: a read-only or full file system, /proc, ...
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ApcscoreError(f"{what} {out}: cannot write in {folder} ({e.strerror or e}) — choose another {what}") \
            from None


def check_against_model(command: str, opts: RunOptions, data: LoadedDataset, vocab_size: int,
                        tokenizer: Any) -> LoadedDataset:
    """`data` with the records the model cannot run moved to `invalid` (or ApcscoreError without --skip-invalid)."""
    asked = {"prompt-logprobs": opts.prompt_logprobs,
             "logprobs": opts.logprobs if isinstance(opts, GenerateOptions) else None}
    for key, k in asked.items():
        if k is not None and k > vocab_size:
            raise ApcscoreError(f"--{key} {k} is more than the model's vocabulary of {vocab_size} "
                                f"tokens — ask for at most {vocab_size} alternatives")
    empty_has_tokens = bool(list(tokenizer("").input_ids))
    name = str(data.path)
    bad: dict[int, str] = {}
    for r in data.records:
        f = r.fields
        if r.kind == "prompt_token_ids":
            outside = next((t for t in f["prompt_token_ids"] if t >= vocab_size), None)
            if outside is not None:
                bad[r.index] = (f"{name}:{r.line}: 'prompt_token_ids' holds token id {shown(outside)}, outside the "
                                f"model's vocabulary [0, {vocab_size}) — use ids of this model's tokenizer")
        elif r.kind == "prompt" and f["prompt"] == "" and not empty_has_tokens:
            bad[r.index] = (f"{name}:{r.line}: 'prompt' is empty, and the model's tokenizer gives an empty text no "
                            "tokens — give the record some text or remove it")
        elif r.kind == "text" and f["text"] == "":
            bad[r.index] = (f"{name}:{r.line}: 'text' is empty: it has no tokens to score — give the record some "
                            "text or remove it")
    if not bad:
        return data
    invalid = [InvalidRecord(r.index, r.line, r.id, bad[r.index]) for r in data.records if r.index in bad]
    if not opts.skip_invalid:
        raise ApcscoreError(f"{name}: {len(invalid)} of {data.num_records} records cannot run on this model; "
                            "nothing was run:\n" + listed_problems([r.message for r in invalid])
                            + "\nFix these lines, or pass --skip-invalid to write them as error rows and run the rest.")
    return replace(data, records=[r for r in data.records if r.index not in bad],
                   invalid=sorted([*data.invalid, *invalid], key=lambda r: r.index))
