"""The sha256 of a file's (or several files') whole content, kept in a small JSON stamp file so that a later call
on unchanged files does not read them again.

A file's stamp is its name, size, mtime (nanoseconds) and inode: a file rewritten in place gets a new mtime, one
replaced by another file (a rename, a copy, a fresh download) a new inode, so either is hashed again. The stamp
file is a cache only: one that cannot be read or written just means the files are hashed every time.
Used by the weights fingerprint (models/loading.py) and the GGUF conversion cache's key (models/gguf_cache.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

_CHUNK = 1 << 22  # bytes read at a time


def file_stamps(files: list[Path]) -> list[list]:
    """[name, size, mtime_ns, inode] of each file, in the given order."""
    return [[file.name, (st := file.stat()).st_size, st.st_mtime_ns, st.st_ino] for file in files]


def hash_files(files: list[Path]) -> str:
    """Hex sha256 of the files' bytes, concatenated in the given order (streamed, never whole in memory)."""
    h = hashlib.sha256()
    for file in files:
        with file.open("rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def stamped_sha256(files: list[Path], stamp_file: Path) -> str:
    """Hex sha256 of the files' concatenated bytes (`hash_files`): the value kept in `stamp_file` when every
    file's stamp still matches the one stored with it, else hashed now and kept there (best effort)."""
    stamps = file_stamps(files)
    try:
        cached = json.loads(stamp_file.read_text())
        if cached.get("files") == stamps and isinstance(cached.get("sha256"), str):
            return cached["sha256"]
    except (OSError, ValueError, AttributeError):
        pass
    digest = hash_files(files)
    if file_stamps(files) != stamps:  # changed while it was read: give the value, keep no stamp for it
        return digest
    write_cache_file(stamp_file, json.dumps({"sha256": digest, "files": stamps}) + "\n")
    return digest


def write_cache_file(path: Path, text: str) -> None:
    """Write `path` whole (this process's temporary file renamed over it), best effort: where the cache cannot be
    written (OSError), nothing is."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        pass
