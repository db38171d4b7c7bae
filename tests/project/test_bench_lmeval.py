"""benchmarks/bench_lmeval.py without a model (the benchmark itself runs whole lm-eval processes, minutes):
its task copies differ from lm-eval's only in the dataset location, its documents are deterministic, distinct
and load through lm-eval's own task code, and its equality check tells equal runs from different ones."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_lmeval  # noqa: E402
import lmeval_data  # noqa: E402

LM_EVAL_TASKS = Path(__import__("lm_eval").__file__).parent / "tasks"
COPIES = bench_lmeval.TASKS_DIR
DATASET_KEYS = re.compile(r'^"?(dataset_path|dataset_name|dataset_kwargs)"?:')


def without_dataset(text: str) -> list[str]:
    """The lines of a task YAML other than its comments and the dataset location (keys and their block)."""
    out, in_block = [], False
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        if DATASET_KEYS.match(line):
            in_block = True
            continue
        if in_block and line.startswith(" "):
            continue
        in_block = False
        out.append(line.replace("dataset_path: json", "dataset_path: cais/mmlu"))
    return out


def test_task_copies_change_only_the_dataset_location() -> None:
    copies = [p for p in COPIES.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert len([p for p in copies if p.name.startswith("mmlu_")]) >= 20
    for copy in copies:
        rel = copy.relative_to(COPIES)
        src = LM_EVAL_TASKS / ("mmlu/default" / rel.relative_to("mmlu") if rel.parts[0] == "mmlu" else rel)
        if copy.suffix == ".py":
            assert copy.read_text() == src.read_text(), rel
            continue
        assert copy.read_text().startswith("# Copied from lm-eval 0.4.13"), rel
        assert without_dataset(copy.read_text()) == without_dataset(src.read_text()), rel


def test_documents_are_deterministic_distinct_and_load_in_lm_eval(tmp_path) -> None:
    from lm_eval.tasks import TaskManager

    tasks = bench_lmeval.write_real_tasks(tmp_path / "a", 6)
    bench_lmeval.write_real_tasks(tmp_path / "b", 6)
    for path in (tmp_path / "a/data").rglob("*.jsonl"):
        other = tmp_path / "b/data" / path.relative_to(tmp_path / "a/data")
        assert path.read_text().replace(str(tmp_path / "a"), "") == other.read_text().replace(str(tmp_path / "b"), "")
        rows = path.read_text().splitlines()
        assert len(set(rows)) == len(rows), path
    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    loaded = manager.load(["hellaswag", "winogrande", "gsm8k"])["tasks"]
    assert sorted(loaded) == ["gsm8k", "hellaswag", "winogrande"]
    for task in loaded.values():
        docs = list(task.eval_docs)
        assert len(docs) == 6
        assert task.doc_to_text(docs[0]) is not None
    assert len(lmeval_data.WORDS) > 5000


def write_run(folder: Path, ll: float, acc: int, text: str = "4") -> None:
    folder.mkdir(parents=True)
    results = {"results": {"t": {"acc,none": float(acc), "alias": "t"}}, "configs": {"t": {"output_type": "x"}}}
    (folder / "results.json").write_text(json.dumps(results))
    rec = {"doc_id": 0, "filter": "none", "arguments": {"a": ["q", " a"]}, "target": 0,
           "resps": [[[str(ll), "True"]]], "filtered_resps": [[str(ll), "True"]], "metrics": ["acc"], "acc": acc}
    (folder / "samples_t.jsonl").write_text(json.dumps(rec) + "\n")


def test_equality_check(tmp_path) -> None:
    write_run(tmp_path / "hf", -12.5, 1)
    write_run(tmp_path / "near", -12.50005, 1)
    write_run(tmp_path / "far", -12.5002, 1)
    write_run(tmp_path / "wrong", -12.5, 0)
    assert bench_lmeval.compare(tmp_path / "hf", tmp_path / "near") == ({"t": 1}, [])
    assert bench_lmeval.compare(tmp_path / "hf", tmp_path / "far")[1]
    diffs = bench_lmeval.compare(tmp_path / "hf", tmp_path / "wrong")[1]
    assert any("results.t.acc,none" in d for d in diffs) and any("doc 0 none acc" in d for d in diffs)
