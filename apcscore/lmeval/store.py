"""Finished lm-eval responses on disk, keyed by what decides them: the journal of `eval --resume`, the shards of
`eval --shard` / `--ray`, and the results cache of `eval --cache DIR`.

A store folder holds one file per engine configuration, `responses-<id>.jsonl`, where <id> is the first 16
hex digits of the sha256 of the configuration's *identity* (`identity`: the EVAL view of io/identity.py, every
field that changes a response's numbers and none that does not: the model's weights and files, dtype, device
type, backends, numerics, apcscore's version and numerics code, the library versions). So a folder can hold the
responses of many models side by side, and a run reads only the file of its own configuration: never another
model's, never other numerics (the file's first line repeats the identity, and it is compared whole).

Each further line is `{"k": KEY, "v": VALUE}`, appended and flushed as a response is finished, so an
interrupted run keeps everything it finished (a line cut by a crash is ignored when read). KEY is the sha256
of the engine request the response came from, as tokens (`loglikelihood_key`, `generation_key`): the token ids
after truncation and, for a generation, every sampling setting, the seed included. Tokens rather than
lm-eval's strings, so that --max-length, BOS and chat-template choices are in the key by construction.

Values are exact: a loglikelihood is a float64 written by `json` as its shortest round-trip repr, a
generation its token ids. A response read from a store is therefore bitwise the one computed (on a
batch-invariant engine, also bitwise what a recompute gives: docs/architecture.md, "The contract").
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from apcscore.errors import ApcscoreError
from apcscore.io.identity import EVAL, short, view

PREFIX = "responses-"


def identity(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The identity of a configuration from a run's metadata (lmeval/results.config_sections): io/identity's EVAL view."""
    return view(meta, EVAL)


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
    """The responses of one configuration: read from store folders, appended to one of them (the journal).

    folders: where to read from (a missing folder or file is empty); journals: the folders whose files new
    responses are appended to (read too; none: nothing written, e.g. a merge). `get`, `put`, `close`."""

    def __init__(self, ident: Mapping[str, Any], folders: Iterable[Path] = (), journals: Iterable[Path] = ()) -> None:
        self.identity = dict(ident)
        self.name = f"{PREFIX}{identity_id(self.identity)}.jsonl"
        self._values: dict[str, Any] = {}
        journals = [Path(j) for j in dict.fromkeys(journals)]
        held: dict[Path, set[str]] = {}
        for folder in dict.fromkeys([*map(Path, folders), *journals]):
            held[folder] = self._load(folder / self.name)
        self.read = len(self._values)  # responses found in the folders
        self._files: list[tuple[Any, set[str]]] = []  # each journal and the keys it holds
        for folder in journals:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / self.name
            fresh = not path.exists() or path.stat().st_size == 0
            self._files.append((open(path, "a", encoding="utf-8"), held[folder]))
            if fresh:
                self._write({"apcscore_responses": 1, "identity": self.identity})

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
            why = "; ".join(f"{k}: {short(found.get(k), 80)} vs {short(self.identity.get(k), 80)}"
                            for k in sorted(found.keys() | self.identity.keys())
                            if found.get(k) != self.identity.get(k)) if isinstance(found, dict) \
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
        self._write({"k": key, "v": value}, key)
        return value

    def put(self, key: str, value: Any) -> None:
        """Keep `value` under `key` and append it to the journal (flushed: an interruption loses none)."""
        if key in self._values:
            return
        self._values[key] = value
        self._write({"k": key, "v": value}, key)

    def write_all(self) -> None:
        """Append every response held to the journals (a merge's folder gets the union of its shards')."""
        for key, value in self._values.items():
            self._write({"k": key, "v": value}, key)

    def _write(self, entry: dict, key: str | None = None) -> None:
        """Append `entry` to each journal (those that do not hold `key` yet, when given)."""
        # one write of a whole line to a file opened for appending: concurrent writers do not interleave lines
        line = json.dumps(entry, separators=(",", ":")) + "\n"
        for f, keys in self._files:
            if key is not None:
                if key in keys:
                    continue
                keys.add(key)
            f.write(line)
            f.flush()

    def close(self) -> None:
        """Flush the journals to disk and close them."""
        for f, _ in self._files:
            if not f.closed:
                f.flush()
                os.fsync(f.fileno())
                f.close()


def _parse(line: str) -> Any:
    try:
        return json.loads(line)
    except ValueError:
        return None


def store_files(folder: Path) -> list[Path]:
    """The store files in `folder`."""
    return sorted(Path(folder).glob(f"{PREFIX}*.jsonl"))
