"""lm-eval's own command line with the backend "apcscore": `python -m apcscore.lmeval ARGS...` and `apcscore
lm-eval ARGS...` (apcscore/lmeval/__main__.py), and the `lm_eval.models` entry point of pyproject.toml.

The end-to-end runs are subprocesses on the local tasks of tests/lmeval_tasks/ (their data paths are relative
to the repository root), `--limit` small and max_length 64: lm-eval's results JSON and samples files must be
written, with the task's metrics.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

REPO = Path(__file__).resolve().parent.parent


def test_entry_point_names_the_model_class() -> None:
    """pyproject.toml's `lm_eval.models` entry point is `module:attr` of the class lm-eval registers."""
    from apcscore.lmeval.model import ApcscoreLM

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    value = project["entry-points"]["lm_eval.models"]["apcscore"]
    module, attr = value.split(":")
    assert getattr(importlib.import_module(module), attr) is ApcscoreLM


def test_registry_has_apcscore_and_the_builtins_after_import() -> None:
    import apcscore.lmeval.model  # noqa: F401
    from lm_eval.api.registry import get_model

    from apcscore.lmeval.model import ApcscoreLM

    assert get_model("apcscore") is ApcscoreLM
    assert get_model("hf").__name__ == "HFLM"  # registering ours did not hide lm-eval's own


def lm_eval_run(entry: list[str], task: str, out: Path, model: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", *entry, "--model", "apcscore",
           "--model_args", f"pretrained={model},dtype=float32,max_length=64", "--device", "cpu",
           "--tasks", task, "--include_path", "tests/lmeval_tasks", "--limit", "3",
           "--log_samples", "--output_path", str(out)]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = list(out.rglob("results_*.json"))
    assert len(results) == 1, (results, done.stderr[-2000:])
    assert list(out.rglob(f"samples_{task}_*.jsonl"))
    return json.loads(results[0].read_text())


@pytest.mark.slow
def test_python_m_apcscore_lmeval_runs_lm_eval_with_apcscore(tmp_path, default_model_files) -> None:
    res = lm_eval_run(["apcscore.lmeval"], "apc_mc", tmp_path / "out", str(default_model_files.path))
    metrics = res["results"]["apc_mc"]
    assert {"acc,none", "acc_norm,none"} <= set(metrics)
    assert res["config"]["model"] == "apcscore"
    assert res["n-samples"]["apc_mc"]["effective"] == 3


@pytest.mark.slow
def test_apcscore_lm_eval_command_passes_arguments_through(tmp_path, default_model_files) -> None:
    res = lm_eval_run(["apcscore", "lm-eval"], "apc_gen", tmp_path / "out", str(default_model_files.path))
    assert "exact_match,none" in res["results"]["apc_gen"]
    assert res["config"]["model"] == "apcscore"
