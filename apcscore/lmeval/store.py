"""Finished lm-eval responses on disk, keyed by what decides them: the journal of `eval --resume`, the shards of
`eval --shard` / `--ray`, and the results cache of `eval --cache DIR` (docs/eval_jobs.md).

A folder holds one `responses-<id>.jsonl` per configuration (<id>: the sha256 of its `identity`, io/identity.py's
EVAL view, which the first line repeats and is compared whole). Each further line is `{"k": KEY, "v": VALUE}`,
appended and flushed under an exclusive `flock`; a line cut by a crash is ignored when read and cut off when the
file is opened to append. KEY is the sha256 of the engine request as tokens (`loglikelihood_key`,
`generation_key`); VALUE is exact (a float64's shortest repr, or token ids), so a stored response is bitwise the
one computed."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from pathlib import Path
from typing import IO, Any, Iterable, Iterator, Mapping

from apcscore.errors import ApcscoreError
from apcscore.io.identity import short

PREFIX = "responses-"


def identity_differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """Where two eval identities differ, each as `field: OLD vs NEW`."""
    return [f"{k}: {short(old.get(k), 80)} vs {short(new.get(k), 80)}" for k in sorted(old.keys() | new.keys())
            if old.get(k) != new.get(k)]


def identity_id(ident: Mapping[str, Any]) -> str:
    """The 16 hex digits naming a configuration's file."""
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def _key(parts: list[Any]) -> str:
    return hashlib.sha256(json.dumps(parts, separators=(",", ":")).encode()).hexdigest()


def loglikelihood_key(tokens: list[int], score_from: int) -> str:
    """The key of a scored sequence (`tokens` as fed, after truncation; continuation from `score_from`)."""
    return _key(["loglikelihood", [int(t) for t in tokens], int(score_from)])


def generation_key(prompt: list[int], sampling: Any) -> str:
    """The key of a generation: its prompt tokens and every sampling setting (seed and stop strings too)."""
    settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in sorted(vars(sampling).items())}
    return _key(["generate", [int(t) for t in prompt], settings])


class ResponseStore:
    """The responses of one configuration, read from `folders` and `journals` (a missing file is empty) and appended
    to the journals (none: nothing written, e.g. a merge)."""

    def __init__(self, ident: Mapping[str, Any], folders: Iterable[Path] = (), journals: Iterable[Path] = ()) -> None:
        self.identity = dict(ident)
        self.name = f"{PREFIX}{identity_id(self.identity)}.jsonl"
        self._values: dict[str, Any] = {}
        self.notes: list[str] = []  # what a caller should tell the user (a torn last line cut off)
        journals = [Path(j) for j in dict.fromkeys(journals)]
        opened = [self._open_journal(folder / self.name) for folder in journals]  # (tails repaired before reading)
        try:
            held = {folder: self._load(folder / self.name)
                    for folder in dict.fromkeys([*map(Path, folders), *journals])}
        except BaseException:
            for f in opened:
                f.close()
            raise
        self.read = len(self._values)  # responses found in the folders
        self._files: list[tuple[IO[str], set[str]]] = [(f, held[folder]) for folder, f in zip(journals, opened)]

    def _open_journal(self, path: Path) -> IO[str]:
        """`path` opened to append: a last line without its newline (cut by a crash) is cut off, and a new (or
        empty) file gets the header line."""
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a+", encoding="utf-8")  # a+: the repair reads the file's end
        with _locked(f):
            cut = _cut_torn_line(f.fileno())
            if cut:
                self.notes.append(f"{path}: its last line was cut short ({cut} bytes without a newline: the run "
                                  "writing it stopped mid-line) and is removed; its response, if any, is computed "
                                  "again")
            if os.fstat(f.fileno()).st_size == 0:
                f.write(json.dumps({"apcscore_responses": 1, "identity": self.identity}, separators=(",", ":")) + "\n")
                f.flush()
        return f

    def _load(self, path: Path) -> set[str]:
        """Read the store file `path` (refused when of another identity); the keys it holds."""
        keys: set[str] = set()
        if not path.is_file():
            return keys
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
        head = _parse(lines[0]) if lines else None
        if not isinstance(head, dict) or head.get("identity") != self.identity:
            found = head.get("identity") if isinstance(head, dict) else None
            why = "; ".join(identity_differences(found, self.identity)) if isinstance(found, dict) \
                else "its first line is not a store header"
            raise ApcscoreError(f"{path}: responses of another configuration ({why}); this is not this run's "
                                "store — remove the file or choose another folder")
        for line in lines[1:]:
            entry = _parse(line)
            if isinstance(entry, dict) and "k" in entry and "v" in entry:  # a cut last line is skipped
                self._values.setdefault(entry["k"], entry["v"])
                keys.add(entry["k"])
        return keys

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key: str) -> bool:
        return key in self._values

    def get(self, key: str) -> Any:
        """The stored value of `key` (KeyError if none), appended to each journal that lacks it (a hit in the
        results cache goes into this run's journal too, so a shard's journal holds every response it gave)."""
        value = self._values[key]
        self._write(key, value)
        return value

    def put(self, key: str, value: Any) -> None:
        """Keep `value` under `key` and append it to the journal (flushed: an interruption loses none)."""
        if key in self._values:
            return
        self._values[key] = value
        self._write(key, value)

    def write_all(self) -> None:
        """Append every response held to the journals (a merge's folder gets the union of its shards')."""
        for key, value in self._values.items():
            self._write(key, value)

    def _write(self, key: str, value: Any) -> None:
        """Append the line of `key` and `value` to each journal that does not hold `key` yet."""
        # one write of a whole line to a file opened for appending, under the file's lock: concurrent writers
        # neither interleave lines nor cut a line another is writing (_open_journal's repair)
        line = json.dumps({"k": key, "v": value}, separators=(",", ":")) + "\n"
        for f, keys in self._files:
            if key in keys:
                continue
            keys.add(key)
            with _locked(f):
                f.write(line)
                f.flush()

    def close(self) -> None:
        """Flush the journals to disk and close them."""
        for f, _ in self._files:
            if not f.closed:
                f.flush()
                os.fsync(f.fileno())
                f.close()


@contextlib.contextmanager
def _locked(f: IO[str]) -> Iterator[None]:
    """An exclusive `flock` on the open file `f` for the block; none where the file system has no locks (ENOLCK,
    e.g. NFS without its lock service: docs/eval_jobs.md says what a shared --cache can then lose)."""
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        locked = True
    except OSError:
        locked = False
    try:
        yield
    finally:
        if locked:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _cut_torn_line(fd: int) -> int:
    """Truncate the file `fd` (open for reading and writing) after its last newline: a line that a crash cut
    short has none, and the next append would be glued onto it. The number of bytes cut (0: it was whole)."""
    size = end = os.fstat(fd).st_size
    keep = 0
    while end > 0:
        start = max(0, end - (1 << 16))
        at = os.pread(fd, end - start, start).rfind(b"\n")
        if at >= 0:
            keep = start + at + 1
            break
        end = start
    if keep < size:
        os.ftruncate(fd, keep)
    return size - keep


def _parse(line: str) -> Any:
    try:
        return json.loads(line)
    except ValueError:
        return None


def store_files(folder: Path) -> list[Path]:
    """The store files in `folder`."""
    return sorted(Path(folder).glob(f"{PREFIX}*.jsonl"))
