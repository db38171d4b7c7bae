"""The response journal after a crash (issue 53, item 6), without a model: a torn last line is cut off when the
journal is opened to append, so the resumed run's first response is not glued onto it; appends hold the file's
lock, so a run sharing the file never cuts or interleaves another's line."""

from __future__ import annotations

import fcntl
import json
import threading
import time

from apcscore.lmeval.store import ResponseStore
from tests.lmeval.test_lmeval_identity import identity, sections


def entries(path) -> list[dict]:
    """Every line of the journal `path`, parsed (a line that does not parse fails the test)."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n")[:-1]]


def test_a_torn_last_line_is_cut_and_the_first_new_response_kept(tmp_path) -> None:
    ident, out = identity(sections()), tmp_path / "out"
    store = ResponseStore(ident, journals=[out])
    store.put("k1", [-1.5, True])
    store.put("k2", [-2.5, False])
    store.close()
    path = out / store.name
    whole = path.read_bytes()
    with path.open("a", encoding="utf-8") as f:
        f.write('{"k":"k3","v":[-3.2')  # the crash: a line without its end
    resumed = ResponseStore(ident, journals=[out])
    assert "k3" not in resumed and len(resumed) == 2
    resumed.put("k4", [-4.0, True])  # the first new response: it used to be glued onto the torn line, and lost
    resumed.close()
    assert [e.get("k") for e in entries(path)] == [None, "k1", "k2", "k4"]
    assert path.read_bytes().startswith(whole)
    again = ResponseStore(ident, folders=[out])
    assert again.get("k4") == [-4.0, True] and len(again) == 3
    assert resumed.notes == [f"{path}: its last line was cut short (19 bytes without a newline: the run writing it "
                             "stopped mid-line) and is removed; its response, if any, is computed again"]
    assert again.notes == []


def test_a_torn_header_starts_the_journal_afresh(tmp_path) -> None:
    """A crash while the header was written left a first line that is not a store header: the journal could never
    be opened again ("not this run's store")."""
    ident, out = identity(sections()), tmp_path / "out"
    path = out / ResponseStore(ident).name
    out.mkdir()
    path.write_text('{"apcscore_responses":1,"ident', encoding="utf-8")
    store = ResponseStore(ident, journals=[out])
    store.put("k1", [-1.0, True])
    store.close()
    assert len(store.notes) == 1 and entries(path) == [{"apcscore_responses": 1, "identity": ident},
                                                        {"k": "k1", "v": [-1.0, True]}]


def test_an_append_waits_for_the_lock_of_another_writer(tmp_path) -> None:
    """A run sharing the journal (a --cache folder) holds its lock while it appends or repairs the file; ours waits,
    so neither cuts nor interleaves the other's line."""
    ident, cache = identity(sections()), tmp_path / "cache"
    store = ResponseStore(ident, journals=[cache])
    path = cache / store.name
    with path.open("a", encoding="utf-8") as other:
        fcntl.flock(other.fileno(), fcntl.LOCK_EX)
        writer = threading.Thread(target=store.put, args=("k1", [-1.0, False]))
        writer.start()
        time.sleep(0.3)
        assert writer.is_alive() and len(entries(path)) == 1  # waiting: only the header so far
        other.write('{"k":"k0","v":[-0.5,true]}\n')
        other.flush()
        fcntl.flock(other.fileno(), fcntl.LOCK_UN)
        writer.join(10)
    store.close()
    assert [e.get("k") for e in entries(path)] == [None, "k0", "k1"]
