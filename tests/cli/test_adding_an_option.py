"""Adding an option touches few files (issue 54, goal "a new engine option or sampling option touches <= 3 source
files"): on a copy of the package, the declarations alone make an option whole, with no other edit.

- An engine setting: its `EngineConfig` field with its identity role (config.py) and its command line
  (`ENGINE_OPTIONS`, options/specs.py) give the flag on every command that runs a model, its --help line in the
  Engine panel, its config-file and model_args key, its place in a run's identity; then only its consumer.
- A sampling option: its declaration (a `SamplingOptions` field, config.py: default, check, help text, whether a
  record may set it) gives the flag in generate's Sampling panel, the config key, the per-record field of JSONL,
  CSV and OpenAI Batch lines, the same check everywhere, and the field of SamplingParams, checked by it; then only
  its consumers (the sampler, and the transformers fallback's generate() arguments).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "apcscore"


def _copy_with(tmp: Path, edits: dict[str, tuple[str, str]]) -> Path:
    """A copy of apcscore/ in `tmp` where each file of `edits` has `text` inserted after the line `anchor`."""
    shutil.copytree(PACKAGE, tmp / "apcscore", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for relative, (anchor, text) in edits.items():
        path = tmp / "apcscore" / relative
        source = path.read_text()
        assert source.count(anchor) == 1, (relative, anchor)
        path.write_text(source.replace(anchor, anchor + text))
    return tmp


def _run(root: Path, script: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root), "COLUMNS": "200"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=root,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


_PANELS = """
import json
from typer.testing import CliRunner
from apcscore.cli import app

def panel_of(command, flag):
    page = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"}, color=False).output
    panel = None
    for line in page.splitlines():
        if line.startswith("╭─"):
            panel = line.strip("╭─╮ ")
        elif flag in line.split():
            return panel, " ".join(line.strip("│ ").split())
    return None, None

def parsed(command, args):  # the options the command hands the driver (whose run is replaced)
    import apcscore.run.driver as driver
    seen = {}
    driver.run_command = lambda command, dataset, options, config, console: seen.update(options) or 0
    result = CliRunner().invoke(app, [command, *args])
    assert result.exit_code == 0, result.output
    return seen
"""


def test_a_new_engine_setting_needs_only_its_field_and_its_command_line(tmp_path: Path) -> None:
    root = _copy_with(tmp_path, {
        "config.py": ("    tensor_parallel_size: int = setting(1, Identity(\"the reductions across ranks (exact "
                      "within a degree only)\"))\n",
                      "    spill_blocks: int = setting(8, Identity(\"which blocks spill\", unless_invariant=True))\n"),
        "options/specs.py": ("ENGINE_OPTIONS: dict[str, Spec] = {\n",
                             "    \"spill_blocks\": _engine(\"KV blocks spilled at once.\"),\n"),
    })
    got = _run(root, _PANELS + """
from pathlib import Path
from apcscore.io import identity
from apcscore.options.commands import engine_keys
from apcscore.options.resolve import resolve_options

Path("c.toml").write_text("spill_blocks = 4\\n")
Path("bad.toml").write_text("spill_blocks = \\"4\\"\\n")
meta = {"engine": {"spill_blocks": 8}, "numerics": {"batch_invariant": False}}
try:
    resolve_options("score", {}, Path("bad.toml"))
except Exception as exc:
    refused = str(exc)
print(json.dumps({
    "panels": {c: panel_of(c, "--spill-blocks") for c in ("score", "generate", "perplexity", "eval")},
    "from_cli": resolve_options("score", parsed("score", ["d.jsonl", "--spill-blocks", "2"]), Path("c.toml"))
                .engine.spill_blocks,
    "from_file": resolve_options("eval", {"tasks": "t"}, Path("c.toml")).engine.spill_blocks,
    "default": resolve_options("generate", {}, None).engine.spill_blocks,
    "refused": refused,
    "model_args": "spill_blocks" in engine_keys(),
    "library_gemm": identity.view(meta, "resume").get("engine.spill_blocks"),
    "invariant": "engine.spill_blocks" in identity.view({**meta, "numerics": {"batch_invariant": True}}, "resume"),
    "eval_cache": "engine.spill_blocks" in identity.view(meta, "eval"),
}))
""")
    for command, (panel, line) in got["panels"].items():
        assert panel == "Engine" and line == "--spill-blocks <int> KV blocks spilled at once. [default: 8]", command
    assert (got["from_cli"], got["from_file"], got["default"]) == (2, 4, 8)  # command line > config file > default
    assert got["refused"] == "bad.toml:1: spill_blocks must be an integer, not \"4\" — fix the value"
    assert got["model_args"]
    # the identity as its field declares: compared where the GEMM is a library one, by every view
    assert got["library_gemm"] == 8 and not got["invariant"] and got["eval_cache"]


def test_a_new_sampling_option_needs_only_its_declaration(tmp_path: Path) -> None:
    root = _copy_with(tmp_path, {
        "config.py": ("    top_k: int = sampling(0, _int_at_least_0, \"Sample among the K most likely (0 = off).\")\n",
                      "    min_p: float = sampling(0.0, _number_at_least_0, \"Drop tokens below this share of the top "
                      "one's probability.\")\n"),
    })
    got = _run(root, _PANELS + """
import csv
from pathlib import Path
from apcscore.engine.step import SamplingParams
from apcscore.errors import ApcscoreError
from apcscore.io.reader import load_dataset
from apcscore.jobs.generate import GenerateJob
from apcscore.options.resolve import resolve_options

Path("d.jsonl").write_text(json.dumps({"id": "a", "prompt": "x", "min_p": 0.25}) + "\\n"
                           + json.dumps({"id": "b", "prompt": "y"}) + "\\n")
with open("d.csv", "w", newline="") as f:
    csv.writer(f).writerows([["id", "prompt", "min_p"], ["c", "z", "0.5"]])
body = {"model": "m", "prompt": "w", "max_tokens": 2, "min_p": 0.75}
Path("b.jsonl").write_text(json.dumps({"custom_id": "d", "method": "POST", "url": "/v1/completions",
                                       "body": body}) + "\\n")
Path("bad.jsonl").write_text(json.dumps({"prompt": "x", "min_p": -1}) + "\\n")
Path("c.toml").write_text("min_p = 0.125\\n")
opts = resolve_options("generate", parsed("generate", ["d.jsonl", "--min-p", "0.1"]), None)
job = GenerateJob(None, 100, opts)
values = {r.id: job.sampling_params(r).min_p
          for name in ("d.jsonl", "d.csv", "b.jsonl") for r in load_dataset(name, "generate").records}
values["csv_type"] = type(load_dataset("d.csv", "generate").records[0].fields["min_p"]).__name__
refused = []
for attempt in (lambda: resolve_options("generate", {"min_p": -1.0}, None),
                lambda: load_dataset("bad.jsonl", "generate"), lambda: SamplingParams(min_p=-2)):
    try:
        attempt()
    except ApcscoreError as exc:
        refused.append(str(exc))
print(json.dumps({"panel": panel_of("generate", "--min-p"), "values": values, "refused": refused,
                  "from_file": resolve_options("generate", {}, Path("c.toml")).min_p,
                  "params_default": SamplingParams().min_p}))
""")
    assert got["panel"] == ["Sampling", "--min-p <float> Drop tokens below this share of the top one's probability. "
                                        "[default: 0]"]
    # --min-p is the default of a record without its own; a record's own value wins: JSONL, CSV, OpenAI Batch
    assert {k: got["values"][k] for k in ("a", "b", "c", "csv_type")} == {"a": 0.25, "b": 0.1, "c": 0.5,
                                                                        "csv_type": "float"}
    assert got["values"]["d"] == 0.75 and got["from_file"] == 0.125
    assert "--min-p must be a number >= 0, got -1.0 (the same check as a record's 'min_p')" in got["refused"][0]
    assert "'min_p' must be a number >= 0, got -1" in got["refused"][1]
    assert got["refused"][2] == "min_p must be a number >= 0, got -2" and got["params_default"] == 0.0
