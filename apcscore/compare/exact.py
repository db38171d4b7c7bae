"""`apcscore compare --exact`: fail on any differing bit between two result files (or two eval folders).

Records matched by id; every column both hold compared bit for bit but `IGNORED`; top-K lists of another K on
their common first min(K) entries; the first difference reported as docs/compare.md, "--exact", describes."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from apcscore.compare.metrics import top_k
from apcscore.errors import ApcscoreError

# how a run was scheduled, not what it computed: the prefix cache's hits depend on batching, and a shard's
# record_index on how the dataset was split (scale/shard.py)
IGNORED = ("num_cached_tokens", "record_index")
PER_TOKEN = ("token_", "top_")  # list columns aligned with the record's tokens (position i = token_ids[i])


@dataclass
class FirstDifference:
    """Where two runs first differ."""

    id: str  # the record (eval: task/doc_id/filter/request_index)
    column: str
    position: int | None  # index in the column's list (a token position for per-token columns)
    token: int | None  # token_ids[position] of the baseline, for per-token columns
    base: Any  # the two values at that place (a float shown with its bits)
    new: Any
    columns: list[str] = field(default_factory=list)  # every column that differs in this record

    def describe(self) -> str:
        where = f"record {self.id!r}, column {self.column}"
        if self.position is not None:
            where += f", position {self.position}"
        if self.token is not None:
            where += f" (token id {self.token})"
        others = [c for c in self.columns if c != self.column]
        tail = f"; in this record also {', '.join(others)}" if others else ""
        return f"first difference: {where}: baseline {_show(self.base)}, candidate {_show(self.new)}{tail}"


@dataclass
class ExactDiff:
    """The result of the bitwise comparison."""

    num_records: int
    columns: list[str]  # compared
    differing: dict[str, int]  # column -> records where it differs (only columns that differ)
    num_differing_records: int
    first: FirstDifference | None
    only_one_side: list[str]  # columns not compared because one file lacks them
    notes: list[str] = field(default_factory=list)  # e.g. top-K lists cut to the common K

    @property
    def passed(self) -> bool:
        return self.num_differing_records == 0

    def summary(self) -> str:
        if self.passed:
            return (f"--exact: all {self.num_records} records are bit-identical in {len(self.columns)} columns "
                    f"({', '.join(self.columns)})")
        counts = ", ".join(f"{c} {n}" for c, n in self.differing.items())
        head = (f"--exact: {self.num_differing_records} of {self.num_records} records differ (records per column: "
                f"{counts})")
        return head + ("; " + self.first.describe() if self.first else "")


def _show(v: Any) -> str:
    if isinstance(v, float):
        return f"{v!r} (bits {struct.pack('>d', v).hex()})"
    return repr(v)


def _same(x: Any, y: Any) -> bool:
    """Python values equal bit for bit (floats by their float64 bits: a float32 converts exactly)."""
    if isinstance(x, float) and isinstance(y, float):
        return struct.pack("<d", x) == struct.pack("<d", y)
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y))
    return type(x) is type(y) and x == y


def first_index(x: Any, y: Any) -> int | None:
    """The first index where two lists differ (the shorter length when one is a prefix); None for scalars."""
    if not (isinstance(x, list) and isinstance(y, list)):
        return None
    return next((i for i, (a, b) in enumerate(zip(x, y)) if not _same(a, b)), min(len(x), len(y)))


def _leaf_differs(b: pa.Array, n: pa.Array) -> np.ndarray:
    """[len] mask of elements that differ in bits (nulls equal only nulls)."""
    vb = b.is_valid().to_numpy(zero_copy_only=False)
    vn = n.is_valid().to_numpy(zero_copy_only=False)
    out = vb != vn
    both = vb & vn
    if pa.types.is_floating(b.type) and b.type == n.type:
        width = {16: np.uint16, 32: np.uint32, 64: np.uint64}[b.type.bit_width]
        xb = b.to_numpy(zero_copy_only=False).view(width)
        xn = n.to_numpy(zero_copy_only=False).view(width)
        return out | (both & (xb != xn))
    if b.type != n.type:  # another type is another value (e.g. float32 against float64)
        return out | both
    ne = pc.fill_null(pc.not_equal(b, n), False).to_numpy(zero_copy_only=False)
    return out | (both & ne)


def differs(b: pa.Array, n: pa.Array) -> np.ndarray:
    """[len] mask of rows whose values differ in any bit, for scalar and (nested) list arrays of equal length."""
    b, n = (x.combine_chunks() if isinstance(x, pa.ChunkedArray) else x for x in (b, n))
    is_list = [pa.types.is_list(x.type) or pa.types.is_large_list(x.type) for x in (b, n)]
    if not all(is_list):  # a list against a scalar differs everywhere
        return np.ones(len(b), dtype=bool) if any(is_list) else _leaf_differs(b, n)
    lb = pc.fill_null(pc.list_value_length(b), -1).to_numpy(zero_copy_only=False)
    ln = pc.fill_null(pc.list_value_length(n), -1).to_numpy(zero_copy_only=False)
    out = lb != ln
    same = np.flatnonzero((lb == ln) & (lb > 0))
    if len(same):
        take = pa.array(same)
        cb, cn = b.take(take), n.take(take)
        parents = pc.list_parent_indices(cb).to_numpy(zero_copy_only=False)
        child = differs(pc.list_flatten(cb), pc.list_flatten(cn))
        hit = np.zeros(len(same), dtype=bool)
        np.logical_or.at(hit, parents[child], True)
        out[same[hit]] = True
    return out


def compare_tables(base: pa.Table, new: pa.Table, key: str = "id") -> ExactDiff:
    """Compare two tables whose `key` columns hold the same unique values (any order) bit for bit."""
    idx = pc.index_in(base[key], value_set=new[key])
    if idx.null_count or base.num_rows != new.num_rows:
        missing = base[key].filter(idx.is_null()).to_pylist()[:5]
        raise ApcscoreError(f"--exact: the runs hold different records (e.g. {missing} only in the baseline, or "
                            f"{base.num_rows} against {new.num_rows} records); compare two runs of the same data")
    new = new.take(idx)
    names = [c for c in base.column_names if c in new.column_names and c != key and c not in IGNORED]
    base, new, notes = common_top_k(base, new, names)
    one_side = sorted(set(base.column_names) ^ set(new.column_names))
    masks = {c: differs(base[c], new[c]) for c in names}
    any_row = np.any([np.zeros(base.num_rows, dtype=bool), *masks.values()], axis=0)  # [rows]
    differing = {c: int(m.sum()) for c, m in masks.items() if m.any()}
    first = None
    if any_row.any():
        i = int(np.flatnonzero(any_row)[0])
        first = _first_difference(base, new, i, [c for c in names if masks[c][i]], key)
    return ExactDiff(base.num_rows, names, differing, int(any_row.sum()), first, one_side, notes)


def _first_k(col: pa.ChunkedArray | pa.Array, k: int) -> pa.Array:
    """Each position's top-K list cut to its first k entries (nulls stay null, at both levels)."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    offsets = pc.subtract(arr.offsets, arr.offsets[0])  # the list's own offsets, from 0 (a slice starts later)
    inner = pc.list_slice(arr.flatten(), 0, k, return_fixed_size_list=False)
    return pa.ListArray.from_arrays(offsets, inner, type=arr.type, mask=arr.is_null())


def common_top_k(base: pa.Table, new: pa.Table, names: list[str]) -> tuple[pa.Table, pa.Table, list[str]]:
    """Cut the top-K list columns (`*top_*`, lists of lists) to the smaller K where the two runs stored another K;
    the notes say which and to what."""
    cut: dict[tuple[int, int], list[str]] = {}
    for c in names:
        if "top_" not in c or not all(pa.types.is_list(t[c].type) and pa.types.is_list(t[c].type.value_type)
                                      for t in (base, new)):
            continue
        kb, kn = top_k(base[c]), top_k(new[c])
        if kb != kn:
            k = min(kb, kn)
            base = base.set_column(base.column_names.index(c), c, _first_k(base[c], k))
            new = new.set_column(new.column_names.index(c), c, _first_k(new[c], k))
            cut.setdefault((kb, kn), []).append(c)
    notes = [f"--exact: the baseline stores top-{kb} and the candidate top-{kn}: {', '.join(cols)} compared on "
             f"their first {min(kb, kn)} entries (the common top-{min(kb, kn)})" for (kb, kn), cols in cut.items()]
    return base, new, notes


def _first_difference(base: pa.Table, new: pa.Table, i: int, columns: list[str], key: str) -> FirstDifference:
    """Where row i (aligned) first differs: the earliest token position of a per-token column, else the first
    differing column."""
    values = [(c, base[c][i].as_py(), new[c][i].as_py()) for c in columns]
    found = [(c, first_index(x, y), x, y) for c, x, y in values]
    per_token = [f for f in found if f[0].startswith(PER_TOKEN) and f[1] is not None]
    c, j, x, y = min(per_token, key=lambda f: f[1]) if per_token else found[0]
    token = None
    if c.startswith(PER_TOKEN) and j is not None and "token_ids" in base.column_names:
        ids = base["token_ids"][i].as_py() or []
        token = ids[j] if j < len(ids) else None
    bx, nx = (x, y) if j is None else (_at(x, j), _at(y, j))
    return FirstDifference(str(base[key][i].as_py()), c, j, token, bx, nx, columns)


def _at(v: list, j: int) -> Any:
    return v[j] if j < len(v) else "(no element: the list ends here)"
