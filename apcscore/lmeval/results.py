"""What an eval records beside lm-eval's results: each task's version and config hash, the sections of the run
metadata that describe the model and the engine (the eval identity is made of them, io/identity.py's EVAL view), and
the run metadata of results.json and requests.parquet."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

from apcscore.config import EngineConfig
from apcscore.engine.provenance import describe, package_version, run_header
from apcscore.options.commands import EvalOptions
from apcscore.lmeval.tasks import fewshot_as_multiturn, lm_eval_limit


def task_configs(results: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Each task's version (`metadata.version`) and the sha256 of its config as lm-eval resolved it (results.json's
    `configs`), as JSON with sorted keys."""
    out = {}
    for task, cfg in results.get("configs", {}).items():
        text = json.dumps(cfg, sort_keys=True, default=str, ensure_ascii=False)
        out[task] = {"version": (cfg.get("metadata") or {}).get("version"),
                     "sha256": hashlib.sha256(text.encode()).hexdigest()}
    return out


def config_sections(engine: Any, config: EngineConfig) -> dict[str, Any]:
    """The run metadata's sections that fix the bits (engine/provenance.describe, plus lm-eval's version), of which
    the responses' identity is made; an engine that ran elsewhere (Ray, a merge) brings its own `sections`."""
    sections = getattr(engine, "sections", None) or describe(engine, config)
    return {**sections, "versions": {"lm_eval": package_version("lm_eval"), **sections["versions"]}}


def run_info(sections: Mapping[str, Any], opts: EvalOptions, names: list[str], results: Mapping[str, Any],
             timing: Mapping[str, Any], max_length: int, responses: Mapping[str, Any],
             ray: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Our run metadata (key `apcscore`) for the parquet and results.json: every run's sections and the eval's own,
    `timing` (run/metadata.add_timings) and `responses` (how many computed and read)."""
    return {
        **run_header("eval"),
        "tasks": names, "num_fewshot": opts.num_fewshot, "limit": lm_eval_limit(opts.limit),
        "apply_chat_template": opts.apply_chat_template, "fewshot_as_multiturn": fewshot_as_multiturn(opts),
        "system_instruction": opts.system_instruction, "gen_kwargs": opts.gen_kwargs,
        "max_length": max_length,
        "task_configs": task_configs(results),
        **{k: v for k, v in sections.items() if k not in ("apcscore_version", "code")},
        "responses": dict(responses),
        "timing": dict(timing),
        **({"ray": dict(ray)} if ray is not None else {}),
    }


def tables(results: Mapping[str, Any]) -> list[str]:
    """lm-eval's tables of `results` (tasks, then groups where there are any), as its command line prints them."""
    from lm_eval.utils import make_table

    return [make_table(results)] + ([make_table(results, "groups")] if results.get("groups") else [])
