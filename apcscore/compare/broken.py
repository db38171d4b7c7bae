"""`apcscore compare`: broken numbers (docs/compare.md, "Broken numbers")."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


@dataclass
class Broken:
    """Numbers left out of every figure because one side's is broken: NaN or +-inf, or a value on one side and null on
    the other (null on both is "not scored by design"); they fail the gate by default (`--max-broken 0`)."""

    kinds: dict[str, int] = field(default_factory=dict)  # e.g. "candidate token_logprobs NaN" -> positions
    positions: int = 0  # positions with at least one broken number (either side)
    records: int = 0  # records with at least one (positions or per-record figures)
    examples: list[str] = field(default_factory=list)  # the first records with one, in file order (at most 5)

    def add(self, kind: str, count: int) -> None:
        if count:
            self.kinds[kind] = self.kinds.get(kind, 0) + int(count)

    def describe(self) -> str:
        """One line: what is broken, how often, and the first records."""
        parts = ", ".join(f"{k}: {v}" for k, v in self.kinds.items())
        return (f"{self.positions} position(s) and {self.records} record(s) hold broken numbers ({parts}); first "
                f"records: {', '.join(repr(x) for x in self.examples)}")


def broken_positions(broken: Broken, blp: np.ndarray, bvalid: np.ndarray, nlp: np.ndarray, nvalid: np.ndarray
                      ) -> np.ndarray:
    """Count the positions of one chunk whose target logprob is broken on a side ([p] arrays from `_logprobs`);
    returns the [p] mask of broken positions."""
    bad = np.zeros(len(blp), bool)
    for role, lp, valid, other in (("baseline", blp, bvalid, nvalid), ("candidate", nlp, nvalid, bvalid)):
        nan, inf = valid & np.isnan(lp), valid & np.isinf(lp)
        missing = ~valid & other  # scored on the other side, null here
        broken.add(f"{role} token_logprobs NaN", nan.sum())
        broken.add(f"{role} token_logprobs infinite", inf.sum())
        broken.add(f"{role} token_logprobs null where the other side scored", missing.sum())
        bad |= nan | inf | missing
    return bad


# per-record figures whose value, where present on an ok record, must be finite
RECORD_FIGURES = ("sum_logprob", "mean_nll", "perplexity", "continuation_logprob", "word_perplexity",
                  "byte_perplexity", "bits_per_byte")


def broken_records(base: pa.Table, new: pa.Table) -> tuple[np.ndarray, Broken]:
    """[rows] mask of aligned ok records whose per-record figures (RECORD_FIGURES, choice_logprobs) hold NaN or
    +-inf on a side, or a value on one side and null on the other; and their counts."""
    broken = Broken()
    bad = np.zeros(base.num_rows, bool)
    for name in RECORD_FIGURES + ("choice_logprobs",):
        if name not in base.column_names or name not in new.column_names:
            continue
        flags = []
        for t in (base, new):
            col = t[name]
            if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):  # broken when any entry is
                values = pc.cast(pc.list_flatten(col), pa.float64())
                parent = pc.list_parent_indices(col).to_numpy()
                finite = pc.fill_null(pc.is_finite(values), True).to_numpy(zero_copy_only=False)
                row_bad = np.zeros(t.num_rows, bool)
                row_bad[parent[~finite]] = True
                flags.append((col.is_valid().to_numpy(zero_copy_only=False), row_bad))
            else:
                values = pc.cast(col, pa.float64())
                valid = values.is_valid().to_numpy(zero_copy_only=False)
                flags.append((valid, valid & ~pc.fill_null(pc.is_finite(values), True).to_numpy(zero_copy_only=False)))
        (bv, bb), (nv, nb) = flags
        for role, nonfinite, missing in (("baseline", bb, ~bv & nv), ("candidate", nb, ~nv & bv)):
            broken.add(f"{role} {name} NaN or infinite", nonfinite.sum())
            broken.add(f"{role} {name} null where the other side has one", missing.sum())
            bad |= nonfinite | missing
    return bad, broken
