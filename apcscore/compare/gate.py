"""`apcscore compare`: regression metrics between two result files of the same dataset (no CLI code here).

`compare_files` matches the records by `id` and computes every figure on the positions both files scored
(docs/compare.md, "Metrics"); `evaluate` turns thresholds into pass/fail `Check`s, each tolerance judged by its
one-sided confidence bound (`stats.judge`). Files that cannot be compared raise `ApcscoreError` (exit 2)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from apcscore.compare.inputs import (COMMON_RECORDS, Excluded, FileInfo, LeftOut, check_same_run_kind, file_info,
                                     load_result_file, match_records, split_excluded)
from apcscore.compare.broken import Broken, broken_records
from apcscore.compare.exact import ExactDiff, compare_tables
from apcscore.compare.metrics import (Flip, Metrics, Positions, RecordMetrics, flips, position_data, record_level,
                                      record_rows, token_summary)
from apcscore.compare.stats import DEFAULT_SAMPLES, DEFAULT_SEED, PairedStats, judge, paired_stats
from apcscore.compare.thresholds import DEFAULT_GATE, EXACT_MEAN_KLD, Thresholds
from apcscore.compare.reference_kl import BOUND_LABEL, EXACT_LABEL, apply_exact, candidate_alone, exact_applies, \
    reference_side
from apcscore.errors import ApcscoreError


# ---- The comparison and its gate ----


@dataclass
class Check:
    """One threshold: the figure it reads, the limit, and whether it holds."""

    option: str  # e.g. "--max-ppl-ratio"
    metric: str  # what was measured, e.g. "PPL ratio"
    value: float
    op: str  # "<=" | ">="
    threshold: float
    passed: bool
    source: str = "option"  # where the limit came from: "default", "config <path>", "option"
    bound: str | None = None  # the confidence bound judged, e.g. "lower 95% bound 1.0012"; None: the value itself


@dataclass
class Aligned:
    """The compared records as the figures saw them, kept for reports that draw them (`html_report`)."""

    base: pa.Table  # records ok in both files, the columns compare reads; row i of each is the same record
    new: pa.Table
    positions: Positions | None  # per-position arrays (`record` indexes the rows above); None: no token logprobs


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
    aligned: Aligned | None = field(default=None, repr=False)  # the data behind the figures; not in to_dict
    stats: PairedStats | None = None  # McNemar tests, bootstrap intervals, minimum detectable effects
    broken: Broken = field(default_factory=Broken)  # NaN, +-inf, one-sided positions: left out of every figure
    left_out: LeftOut = field(default_factory=LeftOut)  # records not in both files alike (--common-records)
    kl_label: str = "lower bound from top-K"  # or exact (compare/reference_kl.py)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        """Every figure as JSON-ready data (NaN and infinities become null)."""
        data = asdict(replace(self, aligned=None))
        del data["aligned"]
        return json_ready({"passed": self.passed, **data})


def json_ready(v: Any) -> Any:
    """`v` with every float NaN or infinity, in nested dicts and lists too, as None (JSON has neither)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: json_ready(x) for k, x in v.items()}
    if isinstance(v, list):
        return [json_ready(x) for x in v]
    return v


_KLD_HINT = "re-run score with --prompt-logprobs K (K >= 1) for both files"


def evaluate(c: Comparison, t: Thresholds) -> list[Check]:
    """Turn thresholds into checks, each tolerance with a paired bootstrap judged by its one-sided bound
    (`stats.judge`; `decision` "point": the estimates alone). A limit the user set whose figure cannot be
    computed is a usage error (exit 2), a default one is skipped with a note."""
    m = c.metrics
    checks: list[Check] = []
    intervals = {iv.figure: iv for iv in (c.stats.intervals if c.stats is not None else [])}

    def bounds(figure: str, increasing: Callable[[float], float] = float) -> tuple[float, float] | None:
        """(lower, upper) one-sided bounds of a bootstrap figure, mapped through an increasing function (e.g. exp)."""
        iv = intervals.get(figure)
        return None if iv is None else (increasing(iv.lower), increasing(iv.upper))

    def add(name: str, metric: str, value: float | None, op: str, limit: float,
            bound_pair: tuple[float, float] | None = None, why: str = "") -> None:
        """One check of `value op limit`, judged by the (lower, upper) bounds when given; None: not computable."""
        option = "--" + name.replace("_", "-")
        if value is None:
            if t.source(name) != "default":
                raise ApcscoreError(f"{option} cannot be checked: {why}")
            c.notes.append(f"default {option} not applied: {why}")
            return
        ok, label = judge(value, op, limit, bound_pair, t.decision, t.alpha)
        checks.append(Check(option, metric, value, op, limit, bool(ok) and math.isfinite(value), t.source(name),
                            label))

    if t.max_new_errors is not None:
        new_errors = sum(e.side == "candidate" for e in c.excluded)
        add("max_new_errors", "records ok in baseline, error in candidate", new_errors, "<=", t.max_new_errors)
    if t.max_broken is not None:
        add("max_broken", "positions and records with NaN, +-inf or a one-sided value",
            c.broken.positions + c.broken.records, "<=", t.max_broken)
        if c.broken.kinds:
            c.notes.append(f"broken numbers, left out of every figure: {c.broken.describe()}")
    if t.max_excluded_fraction is not None:
        add("max_excluded_fraction", "share of records excluded (error on either side)",
            len(c.excluded) / c.num_records if c.num_records else 0.0, "<=", t.max_excluded_fraction)
    if c.num_compared == 0:  # no figure exists; the error checks above decide, or nothing can be compared
        if checks and not all(ch.passed for ch in checks):
            c.notes.append("no record is ok in both files: the other thresholds were not evaluated")
            return checks
        raise ApcscoreError(f"no record is ok in both files ({len(c.excluded)} of {c.num_records} failed on one side "
                            "or both): there is nothing to compare — look at the 'error' column of the files")
    if t.max_ppl_ratio is not None:
        add("max_ppl_ratio", "PPL ratio (new / base)", m.ppl_ratio, "<=", t.max_ppl_ratio,
            bounds("ln PPL ratio", math.exp), "the files have no token_logprobs and no per-record sum_logprob with "
            "a token count")
    if t.max_mean_kld is not None:
        exact = c.kl_label == EXACT_LABEL  # (the top-K bound's name is unchanged)
        default = t.source("max_mean_kld") == "default" and t.max_mean_kld == DEFAULT_GATE["max_mean_kld"]
        add("max_mean_kld", f"mean KL(base || new){', exact' if exact else ''}", m.kld.mean if m.kld else None,
            "<=", EXACT_MEAN_KLD if exact and default else t.max_mean_kld, bounds("mean KL"),
            f"it needs top_logprobs in both files (baseline K = {c.base.top_k}, candidate K = {c.new.top_k}); "
            f"{_KLD_HINT}")
    if t.min_top1_agreement is not None:
        add("min_top1_agreement", "top-1 agreement", m.top1_agreement, ">=", t.min_top1_agreement,
            bounds("top-1 agreement"), f"it needs top_ids in both files (baseline K = {c.base.top_k}, candidate "
            f"K = {c.new.top_k}); {_KLD_HINT}")
    if t.max_abs_logprob_diff is not None:
        add("max_abs_logprob_diff", "max |delta logprob|", m.max_abs_logprob_diff, "<=", t.max_abs_logprob_diff,
            why="it needs token_logprobs in both files; score with `apcscore score` (per-token logprobs are "
            "written for prompt records)")
    if t.max_accuracy_drop is not None:  # judged by the exact bounds of the drop from McNemar's flips (stats.mcnemar)
        tests = {mc.kind: (mc.drop_lower, mc.drop_upper) for mc in (c.stats.mcnemar if c.stats else [])}
        drop = None if m.accuracy_base is None else m.accuracy_base - m.accuracy_new
        add("max_accuracy_drop", "accuracy drop (base - new)", drop, "<=", t.max_accuracy_drop, tests.get("acc"),
            "the files have no multiple-choice records (columns pred and correct) scored in both")
        if drop is not None and m.accuracy_norm_base is not None and m.accuracy_norm_new is not None:
            add("max_accuracy_drop", "acc_norm drop (base - new)", m.accuracy_norm_base - m.accuracy_norm_new,
                "<=", t.max_accuracy_drop, tests.get("acc_norm"))
    if c.kl_label == BOUND_LABEL and c.base.top_k and c.new.top_k and min(c.base.top_k, c.new.top_k) < 5 \
            and t.max_mean_kld is not None:
        c.notes.append(f"the KL bound is loose at K = {min(c.base.top_k, c.new.top_k)} (the default limit was chosen "
                       "at K = 5 and 20): score with --prompt-logprobs 5 or more for a gate that sees the tails")
    return checks


def compare_files(baseline: Path, candidate: Path | None, thresholds: Thresholds | None = None,
                  samples: int = DEFAULT_SAMPLES, seed: int = DEFAULT_SEED, common_records: bool = False) -> Comparison:
    """Compare two result files of the same dataset; raise ApcscoreError when they are not comparable.

    `samples`, `seed`: the paired bootstrap (compare/stats.py); `common_records`: --common-records (the others in
    `Comparison.left_out`); candidate None: `baseline` is a `score --reference-model` file, compared with its
    reference side."""
    if candidate is None:
        run = load_result_file(baseline, "result")
        base, new = reference_side(run), candidate_alone(run)
    else:
        base, new = load_result_file(baseline, "baseline"), load_result_file(candidate, "candidate")
    exact = exact_applies(base, new)  # KL and top-1 from the candidate's exact columns (compare/reference_kl.py)
    check_same_run_kind(base, new)
    bt, nt, left_out = match_records(base, new, common_records)  # joined by id; other records refused or left out
    ok, excluded = split_excluded(bt, nt)
    if not ok.all():
        bt, nt = bt.filter(ok), nt.filter(ok)
    notes = []
    has_ids = base.has("token_ids") and new.has("token_ids")  # match_records compared them (or the token counts)
    if not has_ids:
        lacking = [f.role for f in (base, new) if not f.has("token_ids")]
        where = "the files" if len(lacking) == 2 else f"the {lacking[0]} file"
        notes.append(f"no token_ids in {where}: the tokenizers were compared by token counts only")
    vocab = base.vocab_size or new.vocab_size
    tokens = has_ids and base.has("token_logprobs") and new.has("token_logprobs")
    topk = tokens and not exact and all(f.has(c) for f in (base, new) for c in ("top_ids", "top_logprobs"))
    bad_records, broken = broken_records(bt, nt)  # per-record figures that are NaN, +-inf or one-sided
    if bad_records.any():
        broken.records = int(bad_records.sum())
        broken.examples = bt["id"].filter(pa.array(bad_records)).to_pylist()[:5]
        bt, nt = bt.filter(~bad_records), nt.filter(~bad_records)
    pos, kb, kn = position_data(bt, nt, topk, vocab, broken) if tokens else (None, 0, 0)
    if exact and pos is not None:
        apply_exact(pos, nt)
    inferred = False
    if vocab is None and tokens:
        ids = [t["token_ids"] for t in (bt, nt)] + ([pc.list_flatten(t["top_ids"]) for t in (bt, nt)] if topk else [])
        ids_max = [v for col in ids if (v := pc.max(pc.list_flatten(col)).as_py()) is not None]
        if ids_max:
            vocab, inferred = max(ids_max) + 1, True
            notes.append(f"vocab size not in the metadata (model.vocab_size): at least {vocab} (largest token id + 1); "
                         f"the KL bound is then exact only up to float32 rounding when K covers the vocabulary")
    m = Metrics()
    records: list[RecordMetrics] = []
    if pos is not None and len(pos.record):
        token_summary(m, pos)
        records = record_rows(bt["id"].to_pylist(), pos)
        if topk and m.kld is None:
            notes.append(f"KL and top-1 agreement need top-K on both sides (baseline K = {kb}, candidate K = {kn}): "
                         f"not computed; {_KLD_HINT}")
    elif tokens:
        notes.append("no position was scored in both files (multiple-choice records carry no per-token logprobs)")
    if tokens and not topk and not exact:
        where = "one file" if base.has("top_ids") or new.has("top_ids") else "either file"
        notes.append(f"no top_ids/top_logprobs in {where}: KL and top-1 agreement not computed; {_KLD_HINT}")
    notes += record_level(m, bt, nt)
    if excluded:
        notes.append(f"{len(excluded)} record(s) with status 'error' left out of every figure (listed)")
    if left_out.count:
        notes.append(f"{COMMON_RECORDS}: {left_out.count} record(s) not present and identical in both files left out "
                     f"(listed): {left_out.describe()}")
    c = Comparison(file_info(base, kb), file_info(new, kn), vocab, inferred,
                   bt.num_rows + len(excluded) + int(bad_records.sum()), bt.num_rows, m, records, flips(bt, nt),
                   excluded, [], notes, Aligned(bt, nt, pos), broken=broken, left_out=left_out,
                   kl_label=EXACT_LABEL if exact else BOUND_LABEL)
    thresholds = thresholds if thresholds is not None else Thresholds()
    if bt.num_rows:
        c.stats = paired_stats(bt, nt, pos, thresholds.alpha, samples, seed)
        c.notes += c.stats.notes
    c.checks = evaluate(c, thresholds)
    return c


def exact_files(baseline: Any, candidate: Any, common_records: bool = False) -> ExactDiff:
    """`--exact` on two result files of `apcscore score` / `perplexity` (checked as compare checks them); with
    `common_records`, on the records present and identical in both (inputs.match_records)."""
    files, tables = [], []
    for path, role in ((baseline, "baseline"), (candidate, "candidate")):
        f = load_result_file(path, role)  # refuses what is not apcscore output, missing or duplicate ids
        try:
            t = pq.read_table(f.path)
        except (pa.ArrowException, OSError) as e:
            raise ApcscoreError(f"{role} file {f.path} is damaged: its data cannot be read ({e})") from None
        files.append(f)
        tables.append(t.set_column(t.column_names.index("id"), "id", f.table["id"]))
    if common_records:
        kept = match_records(*files, common=True)[0]["id"]
        tables = [t.filter(pc.is_in(t["id"], value_set=kept)) for t in tables]
    return compare_tables(*tables)


def add_exact(checks: list, notes: list[str], diff: ExactDiff) -> None:
    """The --exact verdict as one more threshold (records with a differing bit <= 0) and a note saying where."""
    checks.append(Check("--exact", "records with a differing bit", float(diff.num_differing_records), "<=", 0.0,
                        diff.passed))
    notes += [diff.summary(), *diff.notes]
    if diff.only_one_side:
        notes.append(f"--exact: not compared, in one file only: {', '.join(diff.only_one_side)}")
