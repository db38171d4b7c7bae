"""`apcscore compare`: regression metrics between two result files of the same dataset (no CLI code here).

Two parquet files written by `apcscore score` or `apcscore perplexity` are matched record by record on
`id`; every figure is computed on the token positions both files scored:

- mean NLL of each side, the perplexity ratio, and the mean of ln(PPL_new / PPL_base) with its standard
  error (over positions, as llama.cpp's `llama-perplexity --kl-divergence` reports it);
- KL(base || new) per position, a lower bound computed from the stored top-K (see `apcscore.kl_bound` and
  docs/compare.md), with its mean, max and percentiles;
- top-1 agreement, the change of the target token's probability (mean and RMS), max |delta logprob|;
- for multiple-choice records: accuracy of each side and the records whose prediction flipped.

`compare_files` returns a `Comparison`; thresholds turn it into pass/fail `Check`s. Files that cannot be
compared raise `ApcscoreError` (exit code 2).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from apcscore.errors import ApcscoreError
from apcscore.kl_bound import TopKLogprobs, kl_divergence_topk, solve_unknown_masses  # noqa: F401 (re-exported)

METADATA_KEY = b"apcscore"
KLD_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 50.0)
_CHUNK_POSITIONS = 1 << 16  # positions processed at once: bounds memory to O(chunk x K)
_EXAMPLES = 5  # ids quoted in an error message

# ----------------------------------------------------------------------------------------------------------
# Thresholds
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Thresholds:
    """Pass/fail limits; None = not checked. Fractions, not percent (0.02 = 2 points of accuracy)."""

    max_ppl_ratio: float | None = None  # PPL_new / PPL_base <= this
    max_mean_kld: float | None = None  # mean KL(base || new) per position, nats, <= this
    min_top1_agreement: float | None = None  # share of positions with the same argmax >= this
    max_abs_logprob_diff: float | None = None  # max |logprob_new - logprob_base| of a target token <= this
    max_accuracy_drop: float | None = None  # accuracy_base - accuracy_new (and the same for acc_norm) <= this

    def __post_init__(self) -> None:
        ranges = {"max_ppl_ratio": (0.0, math.inf, False), "max_mean_kld": (0.0, math.inf, True),
                  "min_top1_agreement": (0.0, 1.0, True), "max_abs_logprob_diff": (0.0, math.inf, True),
                  "max_accuracy_drop": (-1.0, 1.0, True)}
        for name, (lo, hi, lo_ok) in ranges.items():
            v = getattr(self, name)
            if v is None:
                continue
            if not (math.isfinite(v) and (v >= lo if lo_ok else v > lo) and v <= hi):
                bound = f"{'>=' if lo_ok else '>'} {lo:g}" + (f" and <= {hi:g}" if math.isfinite(hi) else "")
                raise ApcscoreError(f"--{name.replace('_', '-')} must be {bound}, not {v}")

    def override(self, other: "Thresholds") -> "Thresholds":
        """These thresholds with every value `other` sets (not None) taking precedence."""
        return Thresholds(**{f.name: getattr(other, f.name) if getattr(other, f.name) is not None
                             else getattr(self, f.name) for f in fields(self)})


def load_thresholds(path: Path) -> Thresholds:
    """Read thresholds from the `[thresholds]` table of a TOML file (see configs/compare.toml)."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ApcscoreError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ApcscoreError(f"cannot read config file {path}: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ApcscoreError(f"{path}: not valid TOML: {e}") from None
    known = {f.name for f in fields(Thresholds)}
    extra = set(data) - {"thresholds"}
    if extra:
        raise ApcscoreError(f"{path}: unknown table or key {sorted(extra)}; put the limits under [thresholds]")
    table = data.get("thresholds", {})
    if not isinstance(table, dict):
        raise ApcscoreError(f"{path}: 'thresholds' must be a table ([thresholds])")
    values: dict[str, float] = {}
    for key, value in table.items():
        if key not in known:
            raise ApcscoreError(f"{path}: unknown threshold {key!r} in [thresholds]; known: {', '.join(sorted(known))}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ApcscoreError(f"{path}: [thresholds] {key} must be a finite number, not {value!r}")
        values[key] = float(value)
    return Thresholds(**values)


# ----------------------------------------------------------------------------------------------------------
# Loading and comparability
# ----------------------------------------------------------------------------------------------------------

_COLUMNS = (
    "id", "status", "error", "num_tokens", "num_scored", "sum_logprob", "perplexity", "num_words", "num_bytes",
    "token_ids", "token_logprobs", "top_ids", "top_logprobs",
    "pred", "pred_norm", "correct", "correct_norm", "answer",
)


@dataclass
class ResultFile:
    """One apcscore parquet file: its run metadata and the columns compare reads."""

    path: Path
    role: str  # "baseline" | "candidate", for messages
    meta: dict[str, Any]
    table: pa.Table

    def has(self, column: str) -> bool:
        return column in self.table.column_names

    @property
    def model(self) -> dict[str, Any]:
        model = self.meta.get("model")
        return model if isinstance(model, dict) else {"name": model} if model is not None else {}

    @property
    def vocab_size(self) -> int | None:
        v = self.model.get("vocab_size")
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else None

    @property
    def dataset(self) -> dict[str, Any]:
        ds = self.meta.get("dataset")
        return ds if isinstance(ds, dict) else {}


def load_result_file(path: Path, role: str) -> ResultFile:
    """Open a parquet file written by `apcscore score` / `perplexity`, or refuse with a clear message."""
    path = Path(path)
    if not path.is_file():
        raise ApcscoreError(f"{role} file {path} does not exist")
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as e:
        raise ApcscoreError(f"{role} file {path} is not a parquet file: {e}") from None
    raw = (schema.metadata or {}).get(METADATA_KEY)
    if raw is None:
        raise ApcscoreError(f"{role} file {path} is not apcscore output: its parquet metadata has no 'apcscore' "
                            f"key; compare files written by `apcscore score` or `apcscore perplexity`")
    try:
        meta = json.loads(raw)
        assert isinstance(meta, dict)
    except (ValueError, AssertionError):
        raise ApcscoreError(f"{role} file {path} is not apcscore output: its 'apcscore' metadata is not a JSON "
                            f"object") from None
    missing = [c for c in ("id", "status") if c not in schema.names]
    if missing:
        raise ApcscoreError(f"{role} file {path} is not apcscore output: no column {', '.join(missing)}")
    table = pq.read_table(path, columns=[c for c in _COLUMNS if c in schema.names])
    ids = table["id"]
    if ids.null_count:
        raise ApcscoreError(f"{role} file {path}: {ids.null_count} record(s) have no id")
    if not pa.types.is_string(ids.type):
        table = table.set_column(0, "id", pc.cast(ids, pa.string()))
    counts = pc.value_counts(table["id"])  # struct<values, counts>
    dup = counts.filter(pc.greater(counts.field("counts"), 1))
    if len(dup):
        names = dup.field("values").to_pylist()
        raise ApcscoreError(f"{role} file {path}: duplicate record ids {_examples(names)}; ids must be unique")
    return ResultFile(path, role, meta, table)


def _examples(values: list[Any]) -> str:
    head = ", ".join(repr(v) for v in values[:_EXAMPLES])
    return head + (f" and {len(values) - _EXAMPLES} more" if len(values) > _EXAMPLES else "")


def _check_same_run_kind(base: ResultFile, new: ResultFile) -> None:
    """Refuse files of different commands, datasets or vocabularies (exit 2)."""
    cb, cn = base.meta.get("command"), new.meta.get("command")
    if cb and cn and cb != cn:
        raise ApcscoreError(f"the baseline was written by `apcscore {cb}` and the candidate by `apcscore {cn}`; "
                            f"compare two runs of the same command")
    hb, hn = base.dataset.get("sha256"), new.dataset.get("sha256")
    if hb and hn and hb != hn:
        raise ApcscoreError(
            f"the files are runs on different datasets: baseline {base.dataset.get('path', '?')} (sha256 "
            f"{str(hb)[:12]}...), candidate {new.dataset.get('path', '?')} (sha256 {str(hn)[:12]}...); "
            f"score the same dataset with both models")
    vb, vn = base.vocab_size, new.vocab_size
    if vb and vn and vb != vn:
        raise ApcscoreError(f"the models have different vocabularies (baseline {vb} tokens, candidate {vn}); "
                            f"compare needs the same tokenizer")


def _align(base: ResultFile, new: ResultFile) -> np.ndarray:
    """For each baseline row, the candidate row with the same id; refuse when the id sets differ."""
    pos = pc.index_in(base.table["id"], value_set=new.table["id"])  # [n] int32, null = not in the candidate
    only_base = base.table["id"].filter(pos.is_null()).to_pylist()
    only_new = new.table["id"].filter(pc.invert(pc.is_in(new.table["id"], value_set=base.table["id"]))).to_pylist()
    if only_base or only_new:
        parts = []
        if only_base:
            parts.append(f"{len(only_base)} only in the baseline ({_examples(only_base)})")
        if only_new:
            parts.append(f"{len(only_new)} only in the candidate ({_examples(only_new)})")
        raise ApcscoreError(f"the files hold different records: record ids {'; '.join(parts)}. compare needs two "
                            f"runs on the same dataset")
    return pos.to_numpy(zero_copy_only=False).astype(np.int64)


@dataclass
class Excluded:
    """A record left out of the comparison because it failed in one file or both."""

    id: str
    side: str  # "baseline" | "candidate" | "both"
    error: str


def _excluded(base: pa.Table, new: pa.Table) -> tuple[np.ndarray, list[Excluded]]:
    """ok [n] mask of records with status "ok" in both (aligned tables), and the others, listed."""
    for t, role in ((base, "baseline"), (new, "candidate")):
        bad = pc.invert(pc.is_in(pc.fill_null(t["status"], ""), value_set=pa.array(["ok", "error"])))
        if pc.any(bad).as_py():
            v = t["status"].filter(bad)[0].as_py()
            raise ApcscoreError(f"{role} file: status {v!r} is neither 'ok' nor 'error': not apcscore output")
    ok_b = pc.equal(base["status"], "ok").to_numpy(zero_copy_only=False)
    ok_n = pc.equal(new["status"], "ok").to_numpy(zero_copy_only=False)
    out = []
    err_b = base["error"].to_pylist() if "error" in base.column_names else [None] * len(base)
    err_n = new["error"].to_pylist() if "error" in new.column_names else [None] * len(new)
    for i in np.flatnonzero(~(ok_b & ok_n)):
        side = "both" if not (ok_b[i] or ok_n[i]) else "baseline" if not ok_b[i] else "candidate"
        msg = (f"baseline: {err_b[i] or 'no message'}; candidate: {err_n[i] or 'no message'}" if side == "both"
               else (err_b[i] if side == "baseline" else err_n[i]) or "no message")
        out.append(Excluded(str(base["id"][i].as_py()), side, msg))
    return ok_b & ok_n, out


def _check_token_ids(base: pa.Table, new: pa.Table) -> None:
    """Refuse when a record was tokenized differently on the two sides (aligned tables of ok records)."""
    lb = pc.fill_null(pc.list_value_length(base["token_ids"]), -1).to_numpy()
    ln = pc.fill_null(pc.list_value_length(new["token_ids"]), -1).to_numpy()
    bad = np.flatnonzero(lb != ln)
    if not len(bad):
        vb = pc.list_flatten(base["token_ids"]).to_numpy()
        vn = pc.list_flatten(new["token_ids"]).to_numpy()
        diff = vb != vn
        if not diff.any():
            return
        rec = np.repeat(np.arange(len(base)), np.maximum(lb, 0))[diff]
        bad = np.unique(rec)
    i = int(bad[0])
    tb, tn = base["token_ids"][i].as_py() or [], new["token_ids"][i].as_py() or []
    j = next((k for k, (x, y) in enumerate(zip(tb, tn)) if x != y), min(len(tb), len(tn)))
    ids = [base["id"][int(k)].as_py() for k in bad]
    raise ApcscoreError(
        f"the files were tokenized differently (another tokenizer?): token ids differ in {len(bad)} record(s) "
        f"({_examples(ids)}); record {ids[0]!r}: {len(tb)} tokens in the baseline, {len(tn)} in the candidate, "
        f"first difference at position {j}. compare needs two runs with the same tokenizer")


# ----------------------------------------------------------------------------------------------------------
# Per-position data
# ----------------------------------------------------------------------------------------------------------


def _padded(t: pa.Table, column: str, lengths: np.ndarray, pad: float | int, dtype: type) -> np.ndarray:
    """A list<list<x>> column (one inner list per position) as a padded [sum(lengths), K] array.

    A null outer list (no top-K for that record) gives all-padding rows; a null inner list (an unscored
    position) gives a padding row.
    """
    outer_len = pc.fill_null(pc.list_value_length(t[column]), -1).to_numpy()  # [rows]
    bad = np.flatnonzero((outer_len >= 0) & (outer_len != lengths))
    if len(bad):
        r = int(bad[0])
        raise ApcscoreError(f"record {t['id'][r].as_py()!r}: {column} has {outer_len[r]} positions but token_ids "
                            f"has {lengths[r]}: not apcscore output")
    inner = pc.list_flatten(t[column])  # one list per position of the records that have this column
    inner_len = pc.fill_null(pc.list_value_length(inner), 0).to_numpy()  # [p]
    values = pc.list_flatten(inner).to_numpy(zero_copy_only=False)  # [sum(inner_len)]
    dense = np.full((len(inner_len), int(inner_len.max(initial=0))), pad, dtype=dtype)  # [p, K]
    row = np.repeat(np.arange(len(inner_len)), inner_len)
    col = np.arange(len(values)) - np.repeat(np.cumsum(inner_len) - inner_len, inner_len)
    dense[row, col] = values
    out = np.full((int(lengths.sum()), dense.shape[1]), pad, dtype=dtype)  # [positions, K]
    out[np.repeat(outer_len >= 0, lengths)] = dense
    return out


def _logprobs(t: pa.Table, lengths: np.ndarray) -> np.ndarray:
    """token_logprobs flattened to float64 positions, NaN where a position (or a whole record: a null list,
    e.g. a multiple-choice record) was not scored. [sum(lengths)]"""
    out = np.full(int(lengths.sum()), math.nan)
    has = np.repeat(t["token_logprobs"].is_valid().to_numpy(zero_copy_only=False), lengths)
    flat = pc.cast(pc.list_flatten(t["token_logprobs"]), pa.float64())
    out[has] = pc.fill_null(flat, math.nan).to_numpy(zero_copy_only=False)
    return out


def _same_argmax(bi: np.ndarray, bl: np.ndarray, ni: np.ndarray, nl: np.ndarray) -> np.ndarray:
    """[m] 1 where the argmax is the same on both sides: the top-1 ids match, or one side's top-1 is tied
    for the maximum on the other side (bf16 logits tie often; which tied id comes first is arbitrary)."""
    b_top_tied_in_new = ((ni == bi[:, :1]) & (nl == nl[:, :1])).any(axis=1)  # [m]
    n_top_tied_in_base = ((bi == ni[:, :1]) & (bl == bl[:, :1])).any(axis=1)  # [m]
    return ((bi[:, 0] == ni[:, 0]) | b_top_tied_in_new | n_top_tied_in_base).astype(np.int8)


@dataclass
class _Positions:
    """Per-position arrays over the positions both files scored ([m] each)."""

    record: np.ndarray  # [m] int64, index into the compared records
    base_lp: np.ndarray  # [m] float64 target-token logprob, baseline
    new_lp: np.ndarray  # [m] float64, candidate
    kld: np.ndarray  # [m] float64, NaN where a side has no top-K at that position
    top1: np.ndarray  # [m] int8: 1 same argmax, 0 different, -1 unknown (no top-K)


def _positions(base: pa.Table, new: pa.Table, topk: bool, vocab_size: int | None) -> tuple[_Positions, int, int]:
    """Per-position data of aligned tables (row i of each = the same record), processed in chunks.

    Returns the positions, and the top-K sizes seen on each side (0 when none).
    """
    lengths = pc.fill_null(pc.list_value_length(base["token_ids"]), 0).to_numpy()  # [rows]
    for t, role in ((base, "baseline"), (new, "candidate")):
        lp_len = pc.fill_null(pc.list_value_length(t["token_logprobs"]), -1).to_numpy()
        bad = np.flatnonzero((lp_len >= 0) & (lp_len != lengths))
        if len(bad):
            raise ApcscoreError(f"{role} record {t['id'][int(bad[0])].as_py()!r}: token_logprobs has "
                                f"{lp_len[bad[0]]} entries but token_ids has {lengths[bad[0]]}: not apcscore output")
    parts: list[_Positions] = []
    kb = kn = 0
    ends = np.cumsum(lengths)
    start = 0
    while start < len(base):
        stop = max(start + 1, int(np.searchsorted(ends, ends[start] - lengths[start] + _CHUNK_POSITIONS, "right")))
        b, n, ln = base.slice(start, stop - start), new.slice(start, stop - start), lengths[start:stop]
        rec = np.repeat(np.arange(start, stop), ln)  # [p]
        blp, nlp = _logprobs(b, ln), _logprobs(n, ln)  # [p], [p]
        scored = ~np.isnan(blp) & ~np.isnan(nlp)  # [p]
        rec, blp, nlp = rec[scored], blp[scored], nlp[scored]  # [m]
        kld = np.full(len(rec), math.nan)
        top1 = np.full(len(rec), -1, dtype=np.int8)
        if topk:
            target = pc.list_flatten(b["token_ids"]).to_numpy()[scored]  # [m]
            bi = _padded(b, "top_ids", ln, -1, np.int64)[scored]  # [m, Kb]
            bl = _padded(b, "top_logprobs", ln, -math.inf, np.float64)[scored]  # [m, Kb]
            ni = _padded(n, "top_ids", ln, -1, np.int64)[scored]  # [m, Kn]
            nl = _padded(n, "top_logprobs", ln, -math.inf, np.float64)[scored]  # [m, Kn]
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
        parts.append(_Positions(rec, blp, nlp, kld, top1))
        start = stop
    if not parts:
        z = np.zeros(0)
        return _Positions(np.zeros(0, np.int64), z, z, z, np.zeros(0, np.int8)), kb, kn
    return _Positions(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(_Positions))), kb, kn


# ----------------------------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------------------------


@dataclass
class FileInfo:
    """What the run metadata says about one side."""

    path: str
    command: str | None
    model: str | None
    dtype: str | None
    apcscore_version: str | None
    dataset: str | None
    dataset_sha256: str | None
    vocab_size: int | None
    top_k: int  # largest top-K stored (0 = none)
    num_records: int


@dataclass
class KldSummary:
    """Distribution of the per-position KL(base || new) lower bound, nats."""

    num_positions: int
    mean: float
    max: float
    percentiles: dict[str, float]  # "99.9", "99", "95", "90", "50" -> value


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
    top1_agreement: float | None = None
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


@dataclass
class Check:
    """One threshold: the figure it reads, the limit, and whether it holds."""

    option: str  # e.g. "--max-ppl-ratio"
    metric: str  # what was measured, e.g. "PPL ratio"
    value: float
    op: str  # "<=" | ">="
    threshold: float
    passed: bool


@dataclass
class Comparison:
    """Everything `apcscore compare` found; `passed` is the gate."""

    base: FileInfo
    new: FileInfo
    vocab_size: int | None  # from the metadata, or a lower bound (largest token id + 1)
    vocab_size_inferred: bool
    num_records: int
    num_compared: int  # records with status "ok" in both
    metrics: Metrics
    records: list[RecordMetrics] = field(default_factory=list)  # sorted by mean KL (or |ln PPL ratio|), worst first
    flips: list[Flip] = field(default_factory=list)
    excluded: list[Excluded] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        """Every figure as JSON-ready data (NaN and infinities become null)."""

        def clean(v: Any) -> Any:
            if isinstance(v, float):
                return v if math.isfinite(v) else None
            if isinstance(v, dict):
                return {k: clean(x) for k, x in v.items()}
            if isinstance(v, list):
                return [clean(x) for x in v]
            return v

        return clean({"passed": self.passed, **asdict(self)})


# ----------------------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------------------


def _file_info(f: ResultFile, top_k: int) -> FileInfo:
    def s(v: Any) -> str | None:
        return None if v is None else str(v)

    return FileInfo(str(f.path), s(f.meta.get("command")), s(f.model.get("name")), s(f.meta.get("dtype")),
                    s(f.meta.get("apcscore_version")), s(f.dataset.get("path")), s(f.dataset.get("sha256")),
                    f.vocab_size, top_k, f.table.num_rows)


def _token_summary(m: Metrics, pos: _Positions) -> None:
    d = pos.base_lp - pos.new_lp  # [m] nll_new - nll_base
    n = len(d)
    m.num_positions = n
    m.mean_nll_base, m.mean_nll_new = float(-pos.base_lp.mean()), float(-pos.new_lp.mean())
    m.ppl_base, m.ppl_new = math.exp(m.mean_nll_base), math.exp(m.mean_nll_new)
    m.mean_ln_ppl_ratio = float(d.mean())
    m.ppl_ratio = math.exp(m.mean_ln_ppl_ratio)
    m.mean_ln_ppl_ratio_se = float(d.std(ddof=1) / math.sqrt(n)) if n > 1 else None
    dp = np.exp(pos.new_lp) - np.exp(pos.base_lp)  # [m]
    m.mean_delta_p, m.rms_delta_p = float(dp.mean()), float(np.sqrt((dp * dp).mean()))
    m.max_abs_logprob_diff = float(np.abs(d).max())
    known = pos.top1 >= 0
    if known.any():
        m.top1_agreement = float(pos.top1[known].mean())
    kl = pos.kld[~np.isnan(pos.kld)]
    if len(kl):
        pct = np.percentile(kl, KLD_PERCENTILES)
        m.kld = KldSummary(len(kl), float(kl.mean()), float(kl.max()),
                           {f"{p:g}": float(v) for p, v in zip(KLD_PERCENTILES, pct)})


def _record_rows(ids: list[str], pos: _Positions) -> list[RecordMetrics]:
    """Per-record figures, worst first (by mean KL when known, else by |ln PPL ratio|)."""
    r = len(ids)

    def total(w: np.ndarray, where: np.ndarray | None = None) -> np.ndarray:
        sel = slice(None) if where is None else where
        return np.bincount(pos.record[sel], weights=w[sel] if w is not None else None, minlength=r)

    def seg_max(v: np.ndarray, where: np.ndarray) -> np.ndarray:
        out = np.full(r, -np.inf)
        np.maximum.at(out, pos.record[where], v[where])
        return out

    every = np.ones(len(pos.record), bool)
    n = total(None)
    d = pos.base_lp - pos.new_lp
    has_kl = ~np.isnan(pos.kld)
    n_kl, sum_kl, max_kl = total(None, has_kl), total(np.nan_to_num(pos.kld), has_kl), seg_max(pos.kld, has_kl)
    has_t = pos.top1 >= 0
    n_t, sum_t = total(None, has_t), total(pos.top1.astype(float), has_t)
    max_d = seg_max(np.abs(d), every)
    s_b, s_n, s_d = total(-pos.base_lp), total(-pos.new_lp), total(d)
    rows = [RecordMetrics(ids[i], int(n[i]), s_b[i] / n[i], s_n[i] / n[i], s_d[i] / n[i],
                          sum_kl[i] / n_kl[i] if n_kl[i] else None, max_kl[i] if n_kl[i] else None,
                          sum_t[i] / n_t[i] if n_t[i] else None, max_d[i])
            for i in range(r) if n[i] > 0]
    rows.sort(key=lambda x: (-(x.mean_kld if x.mean_kld is not None else -1.0), -abs(x.ln_ppl_ratio)))
    return rows


def _record_level(m: Metrics, base: pa.Table, new: pa.Table) -> list[str]:
    """Figures from per-record columns: NLL when no per-token logprobs, word/byte perplexity, accuracy."""
    notes = []

    def col(t: pa.Table, name: str, typ=pa.float64()) -> np.ndarray:
        return pc.cast(t[name], typ).to_numpy(zero_copy_only=False) if name in t.column_names else None

    slp_b, slp_n = col(base, "sum_logprob"), col(new, "sum_logprob")
    if slp_b is not None and slp_n is not None:
        nll_b, nll_n = -slp_b, -slp_n
        if m.num_positions == 0:
            cnt = col(base, "num_scored")
            if cnt is None and "perplexity" in base.column_names:  # perplexity = exp(-sum_logprob / count)
                with np.errstate(divide="ignore", invalid="ignore"):
                    cnt = np.rint(nll_b / np.log(col(base, "perplexity")))
                cnt = np.where(np.isfinite(cnt), cnt, np.nan)
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
            nb, nn = col(base, unit), col(new, unit)
            if nb is None or nn is None:
                continue
            ok = ~np.isnan(nll_b) & ~np.isnan(nll_n) & (np.nan_to_num(nb) > 0) & (np.nan_to_num(nn) > 0)
            if not ok.any():
                continue
            for side, nll, cnt in (("base", nll_b, nb), ("new", nll_n, nn)):
                per_unit = nll[ok].sum() / cnt[ok].sum()
                value = math.exp(per_unit) if attr == "word_ppl" else per_unit / math.log(2)
                setattr(m, f"{attr}_{side}", value)
    for pred, correct, attr in (("pred", "correct", "accuracy"), ("pred_norm", "correct_norm", "accuracy_norm")):
        if not all(c in t.column_names for t in (base, new) for c in (pred, correct)):
            continue
        mc = pc.and_(base[pred].is_valid(), new[pred].is_valid()).to_numpy(zero_copy_only=False)
        if mc.any():
            m.num_choice_records = max(m.num_choice_records, int(mc.sum()))
            for side, t in (("base", base), ("new", new)):
                c = pc.fill_null(t[correct], False).to_numpy(zero_copy_only=False)[mc]
                setattr(m, f"{attr}_{side}", float(c.mean()))
    return notes


def _flips(base: pa.Table, new: pa.Table) -> list[Flip]:
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


_KLD_HINT = "re-run score with --prompt-logprobs K (K >= 1) for both files"


def evaluate(c: Comparison, t: Thresholds) -> list[Check]:
    """Turn thresholds into checks; a threshold whose figure cannot be computed is a usage error (exit 2)."""
    m = c.metrics
    checks = []

    def need(value: float | None, option: str, why: str) -> float:
        if value is None:
            raise ApcscoreError(f"{option} cannot be checked: {why}")
        return value

    def add(option: str, metric: str, value: float, op: str, limit: float) -> None:
        ok = value <= limit if op == "<=" else value >= limit
        checks.append(Check(option, metric, value, op, limit, bool(ok)))

    if t.max_ppl_ratio is not None:
        v = need(m.ppl_ratio, "--max-ppl-ratio", "the files have no token_logprobs and no per-record sum_logprob "
                 "with a token count")
        add("--max-ppl-ratio", "PPL ratio (new / base)", v, "<=", t.max_ppl_ratio)
    if t.max_mean_kld is not None:
        v = need(m.kld.mean if m.kld else None, "--max-mean-kld", f"it needs top_logprobs in both files "
                 f"(baseline K = {c.base.top_k}, candidate K = {c.new.top_k}); {_KLD_HINT}")
        add("--max-mean-kld", "mean KL(base || new)", v, "<=", t.max_mean_kld)
    if t.min_top1_agreement is not None:
        v = need(m.top1_agreement, "--min-top1-agreement", f"it needs top_ids in both files (baseline K = "
                 f"{c.base.top_k}, candidate K = {c.new.top_k}); {_KLD_HINT}")
        add("--min-top1-agreement", "top-1 agreement", v, ">=", t.min_top1_agreement)
    if t.max_abs_logprob_diff is not None:
        v = need(m.max_abs_logprob_diff, "--max-abs-logprob-diff", "it needs token_logprobs in both files; "
                 "score with `apcscore score` (per-token logprobs are written for prompt records)")
        add("--max-abs-logprob-diff", "max |delta logprob|", v, "<=", t.max_abs_logprob_diff)
    if t.max_accuracy_drop is not None:
        base_acc = need(m.accuracy_base, "--max-accuracy-drop", "the files have no multiple-choice records "
                        "(columns pred and correct) scored in both")
        add("--max-accuracy-drop", "accuracy drop (base - new)", base_acc - m.accuracy_new, "<=", t.max_accuracy_drop)
        if m.accuracy_norm_base is not None and m.accuracy_norm_new is not None:
            add("--max-accuracy-drop", "acc_norm drop (base - new)", m.accuracy_norm_base - m.accuracy_norm_new,
                "<=", t.max_accuracy_drop)
    return checks


def compare_files(baseline: Path, candidate: Path, thresholds: Thresholds | None = None) -> Comparison:
    """Compare two apcscore result files of the same dataset; raise ApcscoreError when they are not comparable."""
    base, new = load_result_file(baseline, "baseline"), load_result_file(candidate, "candidate")
    _check_same_run_kind(base, new)
    order = _align(base, new)
    same_order = np.array_equal(order, np.arange(len(order)))
    bt, nt = base.table, new.table if same_order else new.table.take(order)
    ok, excluded = _excluded(bt, nt)
    if not ok.all():
        bt, nt = bt.filter(ok), nt.filter(ok)
    notes = []
    has_ids = base.has("token_ids") and new.has("token_ids")
    if has_ids:
        _check_token_ids(bt, nt)
    elif "num_tokens" in bt.column_names and "num_tokens" in nt.column_names:
        diff = pc.not_equal(bt["num_tokens"], nt["num_tokens"]).to_numpy(zero_copy_only=False)
        if np.any(diff):
            ids = bt["id"].filter(pa.array(diff)).to_pylist()
            raise ApcscoreError(f"the files were tokenized differently (another tokenizer?): num_tokens differs in "
                                f"{len(ids)} record(s) ({_examples(ids)})")
        notes.append("no token_ids in the files: the tokenizers were compared by token counts only")
    vocab = base.vocab_size or new.vocab_size
    tokens = has_ids and base.has("token_logprobs") and new.has("token_logprobs")
    topk = tokens and all(f.has(c) for f in (base, new) for c in ("top_ids", "top_logprobs"))
    pos, kb, kn = _positions(bt, nt, topk, vocab) if tokens else (None, 0, 0)
    inferred = False
    if vocab is None and tokens:
        ids_max = [pc.max(pc.list_flatten(t["token_ids"])).as_py() for t in (bt, nt) if len(t)]
        if topk:
            ids_max += [pc.max(pc.list_flatten(pc.list_flatten(t["top_ids"]))).as_py() for t in (bt, nt) if len(t)]
        ids_max = [v for v in ids_max if v is not None]
        if ids_max:
            vocab, inferred = max(ids_max) + 1, True
            notes.append(f"vocab size not in the metadata (model.vocab_size): at least {vocab} (largest token id + 1); "
                         f"the KL bound is then exact only up to float32 rounding when K covers the vocabulary")
    m = Metrics()
    records: list[RecordMetrics] = []
    if pos is not None and len(pos.record):
        _token_summary(m, pos)
        records = _record_rows(bt["id"].to_pylist(), pos)
        if topk and m.kld is None:
            notes.append(f"KL and top-1 agreement need top-K on both sides (baseline K = {kb}, candidate K = {kn}): "
                         f"not computed; {_KLD_HINT}")
    elif tokens:
        notes.append("no position was scored in both files (multiple-choice records carry no per-token logprobs)")
    if tokens and not topk:
        where = "one file" if base.has("top_ids") or new.has("top_ids") else "either file"
        notes.append(f"no top_ids/top_logprobs in {where}: KL and top-1 agreement not computed; {_KLD_HINT}")
    notes += _record_level(m, bt, nt)
    if excluded:
        notes.append(f"{len(excluded)} record(s) with status 'error' left out of every figure (listed)")
    c = Comparison(_file_info(base, kb), _file_info(new, kn), vocab, inferred, bt.num_rows + len(excluded),
                   bt.num_rows, m, records, _flips(bt, nt), excluded, [], notes)
    c.checks = evaluate(c, thresholds or Thresholds())
    return c
