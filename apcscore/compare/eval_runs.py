"""`apcscore compare BASE_DIR CAND_DIR`: two `apcscore eval` output folders, per task and metric, paired by document.

`read_eval_dir` is the one place that reads a folder (its format is lmeval/requests.py's; compare imports nothing of
lmeval/). The runs must have the same tasks, settings, documents, prompts and targets (`check_same_eval`); the
model, dtype, device, backend and code are what is compared (docs/compare.md, "Comparing eval runs")."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from apcscore.compare.divergence import mean_se
from apcscore.compare.exact import ExactDiff, compare_tables
from apcscore.compare.gate import Check, json_ready
from apcscore.compare.inputs import examples
from apcscore.compare.report import _num
from apcscore.compare.thresholds import LIMITS, Thresholds
from apcscore.compare.stats import drop_bounds, judge, mcnemar_exact_p
from apcscore.errors import ApcscoreError

# run settings (results.json's `apcscore` section) that change what an eval measures
RUN_SETTINGS = ("num_fewshot", "limit", "apply_chat_template", "fewshot_as_multiturn", "system_instruction",
                "gen_kwargs", "max_length")
SEEDS = ("random_seed", "numpy_seed", "torch_seed", "fewshot_seed")  # results.json's `config` (lm-eval's)
IGNORED_CONFIG_KEYS = ("metadata.config_source",)  # where the YAML was read from, not what it says
EVAL_THRESHOLDS = ("max_accuracy_drop", "max_ppl_ratio", "max_new_errors", "significance")  # (errors: none)
_RESULT_KEYS = ("name", "alias", "sample_len", "samples")


@dataclass
class EvalRun:
    """One `apcscore eval` folder as compare reads it."""

    path: Path
    meta: dict[str, Any]  # our run metadata (results.json's `apcscore`)
    results: dict[str, dict[str, Any]]  # task -> {"metric,filter": value}
    configs: dict[str, dict[str, Any]]  # task -> lm-eval's resolved task config
    higher_is_better: dict[str, dict[str, bool]]
    config: dict[str, Any]  # lm-eval's run config (seeds...)
    requests: pa.Table


def read_eval_dir(path: Path, role: str) -> EvalRun:
    """Read an `apcscore eval` output folder, or refuse with what is wrong and what to do."""
    path = Path(path)
    if not path.is_dir():
        raise ApcscoreError(f"{role} {path} is {'a file' if path.exists() else 'missing'}: compare takes two eval "
                            "output folders (apcscore eval --out DIR) or two result files, not one of each")
    res_path, req_path = path / "results.json", path / "requests.parquet"
    for p in (res_path, req_path):
        if not p.is_file():
            raise ApcscoreError(f"{role} folder {path} has no {p.name}: not a finished `apcscore eval` run "
                                "(a --shard run's folder must be merged first: apcscore merge)")
    try:
        res = json.loads(res_path.read_text(encoding="utf-8"))
        assert isinstance(res, dict) and isinstance(res.get("results"), dict)
    except (OSError, ValueError, AssertionError) as e:
        raise ApcscoreError(f"{res_path}: not lm-eval results written by apcscore eval ({e or 'no results'})") from None
    meta = res.get("apcscore")
    if not isinstance(meta, dict) or meta.get("command") != "eval":
        raise ApcscoreError(f"{res_path}: no apcscore eval metadata (key 'apcscore'): compare reads folders "
                            "written by `apcscore eval`")
    try:
        table = pq.read_table(req_path)
    except (pa.ArrowException, OSError) as e:
        raise ApcscoreError(f"{req_path}: cannot be read ({e}); run the eval again") from None
    need = {"task", "doc_id", "filter", "request_index", "arguments", "response", "target", "metrics"}
    if need - set(table.column_names):
        raise ApcscoreError(f"{req_path}: no column {', '.join(sorted(need - set(table.column_names)))}: not "
                            "written by apcscore eval")
    return EvalRun(path, meta, res["results"], res.get("configs") or {}, res.get("higher_is_better") or {},
                   res.get("config") or {}, table)


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    return {k.rstrip("."): v for key, value in d.items() for k, v in _flat(value, f"{prefix}{key}.").items()}


def _short(v: Any, n: int = 60) -> str:
    s = json.dumps(v, default=str, ensure_ascii=False)
    return s if len(s) <= n else s[:n - 3] + "..."


def _docs(run: EvalRun) -> dict[tuple[str, str, int], dict[str, Any]]:
    """(task, filter, doc_id) -> {"metrics": {...}, "arguments": [per request], "target": ...}."""
    out: dict[tuple[str, str, int], dict[str, Any]] = {}
    for r in run.requests.select(["task", "filter", "doc_id", "request_index", "arguments", "target",
                                  "metrics"]).to_pylist():
        doc = out.setdefault((r["task"], r["filter"] or "none", int(r["doc_id"])),
                             {"metrics": json.loads(r["metrics"]), "arguments": {}, "target": r["target"]})
        doc["arguments"][r["request_index"]] = r["arguments"]
    return out


def check_same_eval(base: EvalRun, new: EvalRun) -> list[str]:
    """Refuse (ApcscoreError, exit 2) runs of different tasks, settings or documents, naming what differs;
    returns notes."""
    tb, tn = sorted(base.results), sorted(new.results)
    if tb != tn:
        raise ApcscoreError(f"the eval runs have different tasks: baseline {tb}, candidate {tn}; compare runs of "
                            "the same --tasks")
    diffs = [f"{k}: {_short(base.meta.get(k))} vs {_short(new.meta.get(k))}" for k in RUN_SETTINGS
             if base.meta.get(k) != new.meta.get(k)]
    diffs += [f"{k}: {base.config.get(k)} vs {new.config.get(k)}" for k in SEEDS
              if k in base.config and k in new.config and base.config[k] != new.config[k]]
    for task in tb:
        cb, cn = _flat(base.configs.get(task, {})), _flat(new.configs.get(task, {}))
        keys = sorted(k for k in cb.keys() | cn.keys() if k not in IGNORED_CONFIG_KEYS and cb.get(k) != cn.get(k))
        diffs += [f"task {task} config {k}: {_short(cb.get(k))} vs {_short(cn.get(k))}" for k in keys]
    if diffs:
        raise ApcscoreError("the eval runs were run with different settings, so their scores differ whatever the "
                            f"models do (baseline vs candidate): {'; '.join(diffs)}. Run both with the same options")
    db, dn = _docs(base), _docs(new)
    only_b, only_n = ([f"{t} doc {d}" for t, _, d in sorted(x.keys() - y.keys())] for x, y in ((db, dn), (dn, db)))
    if only_b or only_n:
        raise ApcscoreError(f"the eval runs scored different documents: {len(only_b)} only in the baseline "
                            f"({examples(only_b, str)}), {len(only_n)} only in the candidate ({examples(only_n, str)})")
    chat = bool(base.meta.get("apply_chat_template"))
    notes = []
    for key in sorted(db):
        b, n = db[key], dn[key]
        what = ("targets" if b["target"] != n["target"] else
                "prompts" if b["arguments"] != n["arguments"] else None)
        if what is None:
            continue
        where = f"task {key[0]} doc {key[2]}"
        if what == "prompts" and chat:  # each model's own chat template renders the same documents
            notes.append(f"the prompts differ ({where} first): each model applied its own chat template")
            break
        raise ApcscoreError(f"the eval runs hold different {what} for the same document ({where}): another "
                            "dataset or task version; compare runs of the same data")
    return notes


@dataclass
class MetricDelta:
    """One metric of one task on both sides."""

    task: str
    metric: str  # e.g. "acc"
    filter: str
    base: float | None  # lm-eval's aggregate
    new: float | None
    base_stderr: float | None
    new_stderr: float | None
    higher_is_better: bool | None
    num_docs: int = 0  # paired documents with a number on both sides
    mean_doc_delta: float | None = None  # mean of new - base per document
    doc_delta_se: float | None = None  # its standard error (sample std / sqrt(n))
    binary: bool = False  # every per-doc value 0 or 1: a correctness
    flips_to_wrong: int = 0
    flips_to_right: int = 0

    @property
    def delta(self) -> float | None:
        return None if self.base is None or self.new is None else self.new - self.base


@dataclass
class EvalComparison:
    """`apcscore compare` of two eval folders; `passed` is the gate."""

    base: dict[str, Any]  # who ran: model, dtype, device, path...
    new: dict[str, Any]
    tasks: list[str]
    metrics: list[MetricDelta]
    checks: list[Check] = field(default_factory=list)
    check_tasks: list[str] = field(default_factory=list)  # the task of each check
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def cases(self) -> list[tuple[str, bool, str]]:
        """One (case name, passed, message) per task, for a JUnit writer: the task's checks and figures; then one per
        check of the whole run (--exact)."""
        out = []
        for task in self.tasks:
            checks = [c for c, t in zip(self.checks, self.check_tasks) if t == task]
            figures = [f"{m.metric},{m.filter} {_num(m.base)} -> {_num(m.new)} ({_num(m.delta, sign=True)})"
                       for m in self.metrics if m.task == task]
            failed = [f"{c.option}: {c.metric} = {c.value:.6g}, limit {c.op} {c.threshold:g}"
                      for c in checks if not c.passed]
            out.append((task, not failed, "; ".join(failed + figures)))
        return out + [(c.option.lstrip("-"), c.passed, f"{c.metric} = {c.value:.6g}, limit {c.op} {c.threshold:g}")
                      for c, t in zip(self.checks, self.check_tasks) if t not in self.tasks]

    def to_dict(self) -> dict[str, Any]:
        """Every figure as JSON-ready data (NaN and infinities become null)."""
        return json_ready({"kind": "eval", "passed": self.passed, "baseline": self.base, "candidate": self.new,
                           "tasks": self.tasks, "metrics": [{**asdict(m), "delta": m.delta} for m in self.metrics],
                           "checks": [{**asdict(c), "task": t} for c, t in zip(self.checks, self.check_tasks)],
                           "cases": [{"name": n, "passed": p, "message": msg} for n, p, msg in self.cases()],
                           "notes": self.notes})


def _number(v: Any) -> float | None:
    """A number (a bool as 0 / 1), else None (lists, strings: per-sample values that are not one number)."""
    return float(v) if isinstance(v, (int, float)) else None


def metric_deltas(base: EvalRun, new: EvalRun) -> list[MetricDelta]:
    """Every metric of every task: aggregates from results.json, paired per-doc figures from requests.parquet."""
    db, dn = _docs(base), _docs(new)
    out = []
    for task in sorted(base.results):
        rb, rn = base.results[task], new.results.get(task, {})
        for key in rb:
            if key in _RESULT_KEYS or "," not in key or "_stderr," in key:
                continue
            metric, filt = key.split(",", 1)
            hib = (base.higher_is_better.get(task) or {}).get(metric)
            m = MetricDelta(task, metric, filt, _number(rb.get(key)), _number(rn.get(key)),
                            _number(rb.get(f"{metric}_stderr,{filt}")), _number(rn.get(f"{metric}_stderr,{filt}")),
                            hib if isinstance(hib, bool) else None)
            pairs = [(_number(db[k]["metrics"].get(metric)), _number(dn[k]["metrics"].get(metric)))
                     for k in sorted(db) if k[0] == task and k[1] == filt and k in dn]
            pairs = [(x, y) for x, y in pairs if x is not None and y is not None]
            if pairs:
                xb, xn = np.array(pairs, dtype=np.float64).T
                d = xn - xb
                m.num_docs, m.mean_doc_delta = len(d), float(d.mean())
                m.doc_delta_se = mean_se(d)
                m.binary = bool(np.isin(xb, (0.0, 1.0)).all() and np.isin(xn, (0.0, 1.0)).all())
                if m.binary:
                    m.flips_to_wrong = int(((xb == 1) & (xn == 0)).sum())
                    m.flips_to_right = int(((xb == 0) & (xn == 1)).sum())
            out.append(m)
    return out


def evaluate_eval(c: EvalComparison, t: Thresholds) -> None:
    """Per task: --max-accuracy-drop on the higher-is-better 0/1 metrics, judged by the exact one-sided bound of the
    paired per-document drop (the McNemar test beside it), and --max-ppl-ratio on perplexity metrics."""
    given = [name for name in LIMITS if getattr(t, name) is not None and name not in EVAL_THRESHOLDS
             and t.source(name) != "default"]
    if given:
        raise ApcscoreError(f"{', '.join('--' + g.replace('_', '-') for g in given)} cannot be checked on eval runs "
                            "(they hold no per-token logprobs); eval runs take --max-accuracy-drop, "
                            "--max-ppl-ratio and --significance, checked per task")
    for m in c.metrics:
        if t.max_accuracy_drop is not None and m.binary and m.higher_is_better and m.delta is not None:
            drop = m.base - m.new
            lost, gained = m.flips_to_wrong, m.flips_to_right
            what = f"{m.task} {m.metric} drop (base - new)"
            mcnemar_text = (f"McNemar p {mcnemar_exact_p(lost, gained):.3g}: {lost} lost, {gained} gained "
                            f"of {m.num_docs}")
            ok, label = judge(drop, "<=", t.max_accuracy_drop, drop_bounds(lost, gained, m.num_docs, t.alpha),
                              t.decision, t.alpha)
            text = mcnemar_text if label is None else f"{label} ({mcnemar_text})"
            c.checks.append(Check("--max-accuracy-drop", what, drop, "<=", t.max_accuracy_drop, ok,
                                  t.source("max_accuracy_drop"), text))
            c.check_tasks.append(m.task)
        if t.max_ppl_ratio is not None and "perplexity" in m.metric and m.base and m.new is not None:
            ratio = m.new / m.base
            c.checks.append(Check("--max-ppl-ratio", f"{m.task} {m.metric} ratio (new / base)", ratio, "<=",
                                  t.max_ppl_ratio, ratio <= t.max_ppl_ratio, t.source("max_ppl_ratio")))
            c.check_tasks.append(m.task)
    for name, option in (("max_accuracy_drop", "--max-accuracy-drop"), ("max_ppl_ratio", "--max-ppl-ratio")):
        if getattr(t, name) is not None and not any(ch.option == option for ch in c.checks):
            what = "a perplexity metric" if name == "max_ppl_ratio" else "a 0/1 metric such as acc"
            if t.source(name) == "default":
                c.notes.append(f"default {option} not applied: no task of these runs has {what}")
                continue
            raise ApcscoreError(f"{option} cannot be checked: no task of these runs has {what}")


def _side(run: EvalRun) -> dict[str, Any]:
    model = run.meta.get("model") if isinstance(run.meta.get("model"), dict) else {}
    return {"path": str(run.path), "model": model.get("name"), "fingerprint": model.get("fingerprint"),
            "dtype": run.meta.get("dtype"), "device": run.meta.get("device"),
            "model_backend": run.meta.get("model_backend"), "apcscore_version": run.meta.get("apcscore_version")}


def compare_eval_dirs(baseline: Path, candidate: Path, thresholds: Thresholds | None = None) -> EvalComparison:
    """Compare two `apcscore eval` folders; raise ApcscoreError when they are not comparable."""
    base, new = read_eval_dir(baseline, "baseline"), read_eval_dir(candidate, "candidate")
    notes = check_same_eval(base, new)
    c = EvalComparison(_side(base), _side(new), sorted(base.results), metric_deltas(base, new), notes=notes)
    evaluate_eval(c, thresholds or Thresholds())
    return c


def exact_eval(baseline: Path, candidate: Path) -> ExactDiff:
    """`--exact` on eval folders: every column of requests.parquet, rows keyed by task/doc_id/filter/request."""
    tables = []
    for path, role in ((baseline, "baseline"), (candidate, "candidate")):
        t = read_eval_dir(path, role).requests
        key = [f"{a}/{b}/{c}/{d}" for a, b, c, d in zip(*(t[k].to_pylist() for k in
                                                           ("task", "doc_id", "filter", "request_index")))]
        tables.append(t.append_column("id", pa.array(key, pa.string())))
    return compare_tables(*tables)
