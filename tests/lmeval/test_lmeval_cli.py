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

REPO = Path(__file__).resolve().parents[2]


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
def test_python_m_apcscore_lmeval_runs_lm_eval_with_apcscore(tmp_path, default_model_dir) -> None:
    res = lm_eval_run(["apcscore.lmeval"], "apc_mc", tmp_path / "out", str(default_model_dir))
    metrics = res["results"]["apc_mc"]
    assert {"acc,none", "acc_norm,none"} <= set(metrics)
    assert res["config"]["model"] == "apcscore"
    assert res["n-samples"]["apc_mc"]["effective"] == 3


@pytest.mark.slow
def test_apcscore_lm_eval_command_passes_arguments_through(tmp_path, default_model_dir) -> None:
    res = lm_eval_run(["apcscore", "lm-eval"], "apc_gen", tmp_path / "out", str(default_model_dir))
    assert "exact_match,none" in res["results"]["apc_gen"]
    assert res["config"]["model"] == "apcscore"


def _lm_eval(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "apcscore.lmeval", "--model", "apcscore", "--tasks", "apc_mc",
                           "--include_path", "tests/lmeval_tasks", "--limit", "2", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_an_apcscore_error_is_one_error_line_not_a_traceback(tmp_path) -> None:
    done = _lm_eval(["--model_args", f"pretrained={tmp_path / 'none'}", "--device", "cpu"])
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "error: Unknown model" in done.stderr, done.stderr[-2000:]


@pytest.mark.slow
def test_an_unknown_model_arg_is_refused_not_ignored(tmp_path) -> None:
    """Issue 46, item 11: `--model_args pretrained=...,dtpye=float32` ran with the default dtype, exit 0; the
    typo is refused before the model loads, as lm-eval's hf refuses it, with the key it was probably meant to be."""
    from apcscore.errors import ApcscoreError
    from apcscore.lmeval.model import ApcscoreLM

    with pytest.raises(ApcscoreError, match=r"--model_args dtpye: not a setting of the apcscore model \(did you "
                                            r"mean dtype\?\)"):
        ApcscoreLM.create_from_arg_string(f"pretrained={tmp_path / 'none'},dtpye=float32",
                                          {"batch_size": 8, "max_batch_size": None, "device": "cpu"})
    done = _lm_eval(["--model_args", f"pretrained={tmp_path / 'none'},dtpye=float32", "--device", "cpu"])
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "error: --model_args dtpye: not a setting of the apcscore model" in done.stderr


@pytest.mark.slow
def test_without_device_a_machine_without_a_gpu_runs_on_the_cpu(tmp_path, tiny_model_dir) -> None:
    """lm-eval's --device default is cuda:0 (given or not); like its hf model, a CUDA device where there is none
    runs on the CPU (it failed: '--device cuda was asked for'), with a note."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: cuda:0 is available")
    done = _lm_eval(["--model_args", f"pretrained={tiny_model_dir('llama')},dtype=float32,max_length=64",
                     "--output_path", str(tmp_path / "out")])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no CUDA device is available here; running on the CPU" in done.stderr
    assert list((tmp_path / "out").rglob("results_*.json"))
    # a device in --model_args is the user's own: it wins over lm-eval's --device default (both reached the
    # constructor: a TypeError traceback, 'multiple values for keyword argument device'), and is refused here
    done = _lm_eval(["--model_args", f"pretrained={tiny_model_dir('llama')},device=cuda"])
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "error: --device cuda was asked for" in done.stderr, done.stderr[-2000:]
