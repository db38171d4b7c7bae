"""`apcscore compare`, metrics: per position (target logprobs, the KL lower bound, top-1 agreement) and per
record (NLL, word and byte perplexity, multiple-choice accuracy and flips), on aligned tables."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, fields

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from apcscore.compare.broken import Broken, broken_positions
from apcscore.compare.divergence import DeltaPSummary, KldSummary, delta_p_summary, kld_summary, mean_se, share_se
from apcscore.compare.kl_bound import TopKLogprobs, kl_divergence_topk
from apcscore.errors import ApcscoreError

_CHUNK_POSITIONS = 1 << 16  # positions processed at once: bounds memory to O(chunk x K)
_CHUNK_ENTRIES = 1 << 22  # ... and at most this many top-K entries per side (32 MiB a float64 array) at large K


@dataclass
class Metrics:
    """Overall figures on the positions (or records) both files scored; None = not computable here."""

    num_positions: int = 0
    mean_nll_base: float | None = None
    mean_nll_new: float | None = None
    ppl_base: float | None = None
    ppl_new: float | None = None
    ppl_ratio: float | None = None  # PPL_new / PPL_base
    mean_ln_ppl_ratio: float | None = None  # mean over positions of nll_new - nll_base = ln(PPL_new / PPL_base)
    mean_ln_ppl_ratio_se: float | None = None  # standard error of that mean (positions taken as independent)
    kld: KldSummary | None = None
    top1_agreement: float | None = None  # llama.cpp's "same top p"
    top1_agreement_se: float | None = None  # its binomial standard error, as llama.cpp
    delta_p: DeltaPSummary | None = None  # llama.cpp's delta p block: percentiles, min, max, SEs
    mean_delta_p: float | None = None  # mean of p_new(target) - p_base(target)
    rms_delta_p: float | None = None
    max_abs_logprob_diff: float | None = None  # max |logprob_new - logprob_base| of a target token
    num_choice_records: int = 0
    accuracy_base: float | None = None
    accuracy_new: float | None = None
    accuracy_norm_base: float | None = None
    accuracy_norm_new: float | None = None
    word_ppl_base: float | None = None  # perplexity files
    word_ppl_new: float | None = None
    bits_per_byte_base: float | None = None
    bits_per_byte_new: float | None = None


@dataclass
class RecordMetrics:
    """Figures of one record, on the positions both files scored."""

    id: str
    num_positions: int
    mean_nll_base: float
    mean_nll_new: float
    ln_ppl_ratio: float
    mean_kld: float | None
    max_kld: float | None
    top1_agreement: float | None
    max_abs_logprob_diff: float


@dataclass
class Flip:
    """A multiple-choice record whose predicted choice differs between the files."""

    id: str
    kind: str  # "acc" (pred) | "acc_norm" (pred_norm)
    answer: int | None
    pred_base: int
    pred_new: int
    correct_base: bool | None
    correct_new: bool | None


# ---- Per-position data ----


def _padded(t: pa.Table, column: str, lengths: np.ndarray, pad: float | int, dtype: type) -> np.ndarray:
    """A list<list<x>> column (one inner list per position) as a padded [sum(lengths), K] array.

    A null outer list (no top-K for that record) gives all-padding rows; a null inner list (an unscored
    position) gives a padding row.
    """
    inner = pc.list_flatten(t[column])  # one list per position of the records that have this column
    inner_len = pc.fill_null(pc.list_value_length(inner), 0).to_numpy()  # [p]
    values = pc.list_flatten(inner).to_numpy(zero_copy_only=False)  # [sum(inner_len)]
    dense = np.full((len(inner_len), int(inner_len.max(initial=0))), pad, dtype=dtype)  # [p, K]
    row = np.repeat(np.arange(len(inner_len)), inner_len)
    col = np.arange(len(values)) - np.repeat(np.cumsum(inner_len) - inner_len, inner_len)
    dense[row, col] = values
    out = np.full((int(lengths.sum()), dense.shape[1]), pad, dtype=dtype)  # [positions, K]
    out[np.repeat(t[column].is_valid().to_numpy(zero_copy_only=False), lengths)] = dense  # (position_data checked)
    return out


def top_k(col: pa.ChunkedArray | pa.Array) -> int:
    """The largest K of a column of per-position top-K lists (list<list<...>>), read without materializing the
    lists; 0 when it holds none."""
    return int(pc.max(pc.list_value_length(pc.list_flatten(col))).as_py() or 0)


def _logprobs(t: pa.Table, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """token_logprobs flattened to float64 positions ([sum(lengths)], NaN where not scored), and whether each
    position holds a value ([sum(lengths)] bool: False where null, or the whole record's list is null, e.g. a
    multiple-choice record). A held value can itself be NaN or infinite: a broken number, not an unscored one."""
    out = np.full(int(lengths.sum()), math.nan)
    valid = np.zeros(len(out), bool)
    has = np.repeat(t["token_logprobs"].is_valid().to_numpy(zero_copy_only=False), lengths)
    flat = pc.cast(pc.list_flatten(t["token_logprobs"]), pa.float64())
    out[has] = pc.fill_null(flat, math.nan).to_numpy(zero_copy_only=False)
    valid[has] = flat.is_valid().to_numpy(zero_copy_only=False)
    return out, valid


def _same_argmax(bi: np.ndarray, bl: np.ndarray, ni: np.ndarray, nl: np.ndarray) -> np.ndarray:
    """[m] 1 where the argmax is the same on both sides: the top-1 ids match, or one side's top-1 is tied
    for the maximum on the other side (bf16 logits tie often; which tied id comes first is arbitrary)."""
    b_top_tied_in_new = ((ni == bi[:, :1]) & (nl == nl[:, :1])).any(axis=1)  # [m]
    n_top_tied_in_base = ((bi == ni[:, :1]) & (bl == bl[:, :1])).any(axis=1)  # [m]
    return ((bi[:, 0] == ni[:, 0]) | b_top_tied_in_new | n_top_tied_in_base).astype(np.int8)


@dataclass
class Positions:
    """Per-position arrays over the positions both files scored ([m] each)."""

    record: np.ndarray  # [m] int64, index into the compared records
    position: np.ndarray  # [m] int64, the token's index in its record (token_ids[position] is the target)
    base_lp: np.ndarray  # [m] float64 target-token logprob, baseline
    new_lp: np.ndarray  # [m] float64, candidate
    kld: np.ndarray  # [m] float64, NaN where a side has no top-K at that position
    top1: np.ndarray  # [m] int8: 1 same argmax, 0 different, -1 unknown (no top-K)


def position_data(base: pa.Table, new: pa.Table, topk: bool, vocab_size: int | None, broken: Broken
                  ) -> tuple[Positions, int, int]:
    """Per-position data of aligned tables (row i of each = the same record), processed in chunks.

    Returns the positions both sides scored with finite numbers, and the top-K sizes seen on each side (0 when
    none). Positions with a broken number are left out and counted in `broken` (with the first records).
    """
    bad_records = np.zeros(base.num_rows, bool)
    lengths = pc.fill_null(pc.list_value_length(base["token_ids"]), 0).to_numpy()  # [rows]
    for t, role in ((base, "baseline"), (new, "candidate")):
        for column in ("token_logprobs", "top_ids", "top_logprobs") if topk else ("token_logprobs",):
            n = pc.fill_null(pc.list_value_length(t[column]), -1).to_numpy()  # [rows], -1: null (none stored)
            bad = np.flatnonzero((n >= 0) & (n != lengths))
            if len(bad):
                raise ApcscoreError(f"{role} record {t['id'][int(bad[0])].as_py()!r}: {column} has {n[bad[0]]} "
                                    f"entries but token_ids has {lengths[bad[0]]}: not apcscore output")
    z = np.zeros(0)
    parts = [Positions(np.zeros(0, np.int64), np.zeros(0, np.int64), z, z, z, np.zeros(0, np.int8))]  # none: empty
    kb = kn = 0
    ends = np.cumsum(lengths)
    k = max(top_k(base["top_ids"]), top_k(new["top_ids"]), 1) if topk else 1
    chunk = max(1, min(_CHUNK_POSITIONS, _CHUNK_ENTRIES // k))
    start = 0
    while start < len(base):
        stop = max(start + 1, int(np.searchsorted(ends, ends[start] - lengths[start] + chunk, "right")))
        b, n, ln = base.slice(start, stop - start), new.slice(start, stop - start), lengths[start:stop]
        rec = np.repeat(np.arange(start, stop), ln)  # [p]
        at = np.arange(int(ln.sum())) - np.repeat(np.cumsum(ln) - ln, ln)  # [p] index within the record
        (blp, bvalid), (nlp, nvalid) = _logprobs(b, ln), _logprobs(n, ln)  # [p] each
        bad = broken_positions(broken, blp, bvalid, nlp, nvalid)  # [p]
        scored = bvalid & nvalid & ~bad  # [p]
        if topk:
            bl = _padded(b, "top_logprobs", ln, -math.inf, np.float64)  # [p, Kb]
            nl = _padded(n, "top_logprobs", ln, -math.inf, np.float64)  # [p, Kn]
            for role, lps in (("baseline", bl), ("candidate", nl)):  # -inf pads short lists, so NaN and +inf only
                wrong = scored & (np.isnan(lps) | (lps == math.inf)).any(axis=1)  # [p]
                broken.add(f"{role} top_logprobs NaN or +inf", wrong.sum())
                bad |= wrong
                scored &= ~wrong
        broken.positions += int(bad.sum())
        bad_records[rec[bad]] = True
        rec, at, blp, nlp = rec[scored], at[scored], blp[scored], nlp[scored]  # [m]
        kld = np.full(len(rec), math.nan)
        top1 = np.full(len(rec), -1, dtype=np.int8)
        if topk:
            target = pc.list_flatten(b["token_ids"]).to_numpy()[scored]  # [m]
            bi = _padded(b, "top_ids", ln, -1, np.int64)[scored]  # [m, Kb]
            ni = _padded(n, "top_ids", ln, -1, np.int64)[scored]  # [m, Kn]
            bl, nl = bl[scored], nl[scored]  # [m, Kb], [m, Kn]
            if bi.shape != bl.shape or ni.shape != nl.shape:
                raise ApcscoreError("top_ids and top_logprobs have different shapes: not apcscore output")
            kb, kn = max(kb, bi.shape[1]), max(kn, ni.shape[1])
            if bi.shape[1] and ni.shape[1]:
                both = (bi[:, 0] >= 0) & (ni[:, 0] >= 0)  # [m] positions with a top-K on both sides
                top1 = np.where(both, _same_argmax(bi, bl, ni, nl), -1).astype(np.int8)
                w = np.flatnonzero(both)
                if len(w):
                    kld[w] = kl_divergence_topk(TopKLogprobs(target[w], blp[w], bi[w], bl[w]),
                                                TopKLogprobs(target[w], nlp[w], ni[w], nl[w]), vocab_size)
        parts.append(Positions(rec, at, blp, nlp, kld, top1))
        start = stop
    broken.records += int(bad_records.sum())
    broken.examples += [base["id"][int(i)].as_py() for i in np.flatnonzero(bad_records)[:5 - len(broken.examples)]]
    return Positions(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(Positions))), kb, kn


# ---- Per-record data ----


def token_summary(m: Metrics, pos: Positions) -> None:
    d = pos.base_lp - pos.new_lp  # [m] nll_new - nll_base
    m.num_positions = len(d)
    m.mean_nll_base, m.mean_nll_new = float(-pos.base_lp.mean()), float(-pos.new_lp.mean())
    m.ppl_base, m.ppl_new = math.exp(m.mean_nll_base), math.exp(m.mean_nll_new)
    m.mean_ln_ppl_ratio = float(d.mean())
    m.ppl_ratio = math.exp(m.mean_ln_ppl_ratio)
    m.mean_ln_ppl_ratio_se = mean_se(d)
    m.delta_p = delta_p_summary(np.exp(pos.new_lp) - np.exp(pos.base_lp))  # [m] positions: never None here
    m.mean_delta_p, m.rms_delta_p = m.delta_p.mean, m.delta_p.rms
    m.max_abs_logprob_diff = float(np.abs(d).max())
    known = pos.top1 >= 0
    if known.any():
        m.top1_agreement = float(pos.top1[known].mean())
        m.top1_agreement_se = share_se(m.top1_agreement, int(known.sum()))
    m.kld = kld_summary(pos.kld[~np.isnan(pos.kld)])


def record_rows(ids: list[str], pos: Positions) -> list[RecordMetrics]:
    """Per-record figures, worst first (by mean KL when known, else by |ln PPL ratio|)."""
    r = len(ids)

    def total(w: np.ndarray | None, where: np.ndarray | slice = slice(None)) -> np.ndarray:
        return np.bincount(pos.record[where], weights=None if w is None else w[where], minlength=r)

    def seg_max(v: np.ndarray, where: np.ndarray | slice = slice(None)) -> np.ndarray:
        out = np.full(r, -np.inf)
        np.maximum.at(out, pos.record[where], v[where])
        return out

    n = total(None)
    d = pos.base_lp - pos.new_lp
    has_kl = ~np.isnan(pos.kld)
    n_kl, sum_kl, max_kl = total(None, has_kl), total(np.nan_to_num(pos.kld), has_kl), seg_max(pos.kld, has_kl)
    has_t = pos.top1 >= 0
    n_t, sum_t = total(None, has_t), total(pos.top1.astype(float), has_t)
    max_d = seg_max(np.abs(d))
    s_b, s_n, s_d = total(-pos.base_lp), total(-pos.new_lp), total(d)
    rows = [RecordMetrics(ids[i], int(n[i]), s_b[i] / n[i], s_n[i] / n[i], s_d[i] / n[i],
                          sum_kl[i] / n_kl[i] if n_kl[i] else None, max_kl[i] if n_kl[i] else None,
                          sum_t[i] / n_t[i] if n_t[i] else None, max_d[i])
            for i in range(r) if n[i] > 0]
    rows.sort(key=lambda x: (-(x.mean_kld if x.mean_kld is not None else -1.0), -abs(x.ln_ppl_ratio)))
    return rows


def column(t: pa.Table, name: str) -> np.ndarray | None:
    """A column as float64 (NaN for null); None when the table lacks it."""
    return pc.cast(t[name], pa.float64()).to_numpy(zero_copy_only=False) if name in t.column_names else None


def token_counts(t: pa.Table) -> np.ndarray | None:
    """Per record: the tokens its sum_logprob covers (num_scored, else from perplexity = exp(-sum_logprob / count);
    NaN where unknown); None when the table has neither."""
    if "num_scored" in t.column_names or "perplexity" not in t.column_names:
        return column(t, "num_scored")
    with np.errstate(divide="ignore", invalid="ignore"):
        cnt = np.rint(-column(t, "sum_logprob") / np.log(column(t, "perplexity")))
    return np.where(np.isfinite(cnt), cnt, np.nan)


def record_level(m: Metrics, base: pa.Table, new: pa.Table) -> list[str]:
    """Figures from per-record columns: NLL when no per-token logprobs, word/byte perplexity, accuracy."""
    notes = []
    slp_b, slp_n = column(base, "sum_logprob"), column(new, "sum_logprob")
    if slp_b is not None and slp_n is not None:
        nll_b, nll_n = -slp_b, -slp_n
        if m.num_positions == 0:
            cnt = token_counts(base)
            if cnt is not None:
                ok = ~np.isnan(nll_b) & ~np.isnan(nll_n) & (np.nan_to_num(cnt) > 0)
                if ok.any():
                    m.mean_nll_base, m.mean_nll_new = nll_b[ok].sum() / cnt[ok].sum(), nll_n[ok].sum() / cnt[ok].sum()
                    m.ppl_base, m.ppl_new = math.exp(m.mean_nll_base), math.exp(m.mean_nll_new)
                    m.mean_ln_ppl_ratio = m.mean_nll_new - m.mean_nll_base
                    m.ppl_ratio = math.exp(m.mean_ln_ppl_ratio)
                    notes.append("no per-token logprobs in the files: NLL and perplexity come from the per-record "
                                 "sums (no standard error, KL, top-1 agreement or delta p)")
        for unit, attr in (("num_words", "word_ppl"), ("num_bytes", "bits_per_byte")):
            nb, nn = column(base, unit), column(new, unit)
            if nb is None or nn is None:
                continue
            ok = ~np.isnan(nll_b) & ~np.isnan(nll_n) & (np.nan_to_num(nb) > 0) & (np.nan_to_num(nn) > 0)
            if not ok.any():
                continue
            for side, nll, cnt in (("base", nll_b, nb), ("new", nll_n, nn)):
                per_unit = nll[ok].sum() / cnt[ok].sum()
                value = math.exp(per_unit) if attr == "word_ppl" else per_unit / math.log(2)
                setattr(m, f"{attr}_{side}", value)
    for kind, cb, cn in choice_correct(base, new):
        m.num_choice_records = max(m.num_choice_records, len(cb))
        attr = "accuracy" if kind == "acc" else "accuracy_norm"
        setattr(m, f"{attr}_base", float(cb.mean()))
        setattr(m, f"{attr}_new", float(cn.mean()))
    return notes


def choice_correct(base: pa.Table, new: pa.Table) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """Per correctness column both tables hold ("acc": correct, "acc_norm": correct_norm) with a record predicted on
    both sides: the kind, and whether each such record is right in the baseline and in the candidate ([n] bool)."""
    for pred, correct, kind in (("pred", "correct", "acc"), ("pred_norm", "correct_norm", "acc_norm")):
        if not all(c in t.column_names for t in (base, new) for c in (pred, correct)):
            continue
        mc = pc.and_(base[pred].is_valid(), new[pred].is_valid()).to_numpy(zero_copy_only=False)
        if mc.any():
            cb, cn = (pc.fill_null(t[correct], False).to_numpy(zero_copy_only=False)[mc].astype(bool)
                      for t in (base, new))
            yield kind, cb, cn


def flips(base: pa.Table, new: pa.Table) -> list[Flip]:
    out = []
    for pred, correct, kind in (("pred", "correct", "acc"), ("pred_norm", "correct_norm", "acc_norm")):
        if pred not in base.column_names or pred not in new.column_names:
            continue
        pb, pn = base[pred].to_pylist(), new[pred].to_pylist()
        cb = base[correct].to_pylist() if correct in base.column_names else [None] * len(pb)
        cn = new[correct].to_pylist() if correct in new.column_names else [None] * len(pb)
        ans = base["answer"].to_pylist() if "answer" in base.column_names else [None] * len(pb)
        ids = base["id"].to_pylist()
        out += [Flip(ids[i], kind, ans[i], pb[i], pn[i], cb[i], cn[i])
                for i in range(len(pb)) if pb[i] is not None and pn[i] is not None and pb[i] != pn[i]]
    return out
