"""`apcscore compare` on the exact divergence of `score --reference-model`: the candidate's `token_kl` and
`token_top1_agree` replace the top-K bound when its reference is the baseline's model, or when one file is
compared alone with the reference side it carries (docs/compare.md, "Exact KL")."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from apcscore.compare.inputs import ResultFile
from apcscore.compare.metrics import Positions
from apcscore.errors import ApcscoreError

EXACT_LABEL = "exact, from --reference-model"
BOUND_LABEL = "lower bound from top-K"


def exact_applies(base: ResultFile, new: ResultFile) -> bool:
    """Whether the candidate's exact columns are KL(base || new): its reference is the baseline's model."""
    if not (new.has("token_kl") and new.has("token_top1_agree")):
        return False
    if base.meta.get("reference_side_of") == str(new.path):
        return True
    job = new.meta.get("job") if isinstance(new.meta.get("job"), dict) else {}
    ref = job.get("reference_model") if isinstance(job.get("reference_model"), dict) else {}
    return bool(ref.get("fingerprint")) and ref.get("fingerprint") == base.model.get("fingerprint")


def reference_side(f: ResultFile) -> ResultFile:
    """The baseline a file of `score --reference-model` carries: its records with the reference's token logprobs
    and per-record sums (no top-K); records without reference figures (multiple choice) become error rows, left
    out of every figure."""
    t = f.table
    if not f.has("ref_token_logprobs"):
        raise ApcscoreError(f"{f.path} has no reference columns (ref_token_logprobs, token_kl): compare one file "
                            "alone only when it was scored with --reference-model; otherwise give a baseline file")
    lps = t["ref_token_logprobs"]
    sums = [None if v is None else float(np.sum(np.asarray([x for x in v if x is not None], np.float64)))
            for v in lps.to_pylist()]
    keep = [c for c in t.column_names if c not in ("top_ids", "top_logprobs", "pred", "pred_norm", "correct",
                                                   "correct_norm", "choice_logprobs", "perplexity")]
    base = _no_reference_as_errors(t).select(keep)
    base = base.set_column(base.column_names.index("token_logprobs"), "token_logprobs", lps)
    if "sum_logprob" in base.column_names:
        base = base.set_column(base.column_names.index("sum_logprob"), "sum_logprob", pa.array(sums, pa.float64()))
    job = f.meta.get("job") if isinstance(f.meta.get("job"), dict) else {}
    model = job.get("reference_model") if isinstance(job.get("reference_model"), dict) else {}
    meta = {**f.meta, "model": model, "reference_side_of": str(f.path)}
    return ResultFile(f.path, "baseline", meta, base)


def candidate_alone(f: ResultFile) -> ResultFile:
    """The candidate side of a file compared alone: the records its reference side keeps (multiple choice as
    errors on both sides, so that they are left out, not counted as new errors)."""
    return ResultFile(f.path, "candidate", f.meta, _no_reference_as_errors(f.table))


def _no_reference_as_errors(t: pa.Table) -> pa.Table:
    """`t` with its ok records that have no reference figures (token_kl null) turned into error rows."""
    no_ref = pc.and_(pc.equal(t["status"], "ok"), pc.is_null(t["token_kl"])).to_numpy(zero_copy_only=False)
    status = np.where(no_ref, "error", t["status"].to_numpy(zero_copy_only=False))
    return t.set_column(t.column_names.index("status"), "status", pa.array(status.tolist(), pa.string()))


def apply_exact(pos: Positions, new: pa.Table) -> None:
    """pos.kld and pos.top1 from the candidate table's exact columns at the same (record, position)."""
    lengths = pc.fill_null(pc.list_value_length(new["token_kl"]), 0).to_numpy()  # [rows]
    offsets = np.cumsum(lengths) - lengths
    at = offsets[pos.record] + pos.position  # [m]
    kl = pc.fill_null(pc.list_flatten(new["token_kl"]), np.nan).to_numpy(zero_copy_only=False)
    agree = pc.fill_null(pc.cast(pc.list_flatten(new["token_top1_agree"]), pa.int8()), -1).to_numpy(
        zero_copy_only=False)
    pos.kld = kl[at].astype(np.float64)
    pos.top1 = agree[at].astype(np.int8)
