"""`score --reference-model` end to end, and `compare` gating on its exact figures (compare/reference_kl.py): the
columns in the parquet, the run metadata naming the reference, `compare RUN.parquet` alone, two files whose
candidate was scored against the baseline's model, and the report saying "exact"."""

from __future__ import annotations

import json
import math

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from apcscore.cli import app
from apcscore.compare.gate import compare_files
from apcscore.compare.thresholds import EXACT_MEAN_KLD, Thresholds
from apcscore.io.writer import METADATA_KEY

runner = CliRunner()
RECORDS = [{"id": f"r{i}", "prompt": p} for i, p in enumerate(
    ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France, and", "1, 2, 3, 4, 5",
     "Once upon a time there was a small cat who", "Water boils at one hundred degrees"])] + [
    {"id": "mc", "context": "The sky is", "choices": [" blue", " green"], "answer": 0}]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    from tests.engine.test_reference import noisy_copy

    tmp = tmp_path_factory.mktemp("ref-runs")
    ref = tiny_model_dir("llama")
    cand = noisy_copy(ref, tmp / "cand", 0.05)
    data = tmp / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    out = {}
    for name, args in (("paired", ["--model", str(cand), "--reference-model", str(ref)]),
                       ("base", ["--model", str(ref)]), ("cand", ["--model", str(cand)])):
        out[name] = tmp / f"{name}.parquet"
        res = runner.invoke(app, ["score", str(data), *args, "--out", str(out[name]), "--prompt-logprobs", "5",
                                  "-q"])
        assert res.exit_code == 0, res.output
    return out, ref


def test_columns_and_metadata(runs):
    out, ref = runs
    t = pq.read_table(out["paired"])
    rows = {r["id"]: r for r in t.to_pylist()}
    r0 = rows["r0"]
    assert r0["token_kl"][0] is None and all(v >= 0 for v in r0["token_kl"][1:])
    assert math.isclose(r0["mean_kl"], sum(r0["token_kl"][1:]) / (len(r0["token_kl"]) - 1), rel_tol=1e-12)
    assert rows["mc"]["token_kl"] is None and rows["mc"]["mean_kl"] is None
    base = {r["id"]: r for r in pq.read_table(out["base"]).to_pylist()}
    assert r0["ref_token_logprobs"] == base["r0"]["token_logprobs"]  # the reference alone, bit for bit
    meta = json.loads(pq.read_schema(out["paired"]).metadata[METADATA_KEY])
    assert meta["job"]["reference_model"]["path"] == str(ref)
    assert "token_kl" not in pq.read_schema(out["base"]).names


def test_compare_alone_and_against_the_baseline(runs):
    out, _ = runs
    alone = compare_files(out["paired"], None, Thresholds(max_mean_kld=10.0))
    pair = compare_files(out["base"], out["paired"], Thresholds(max_mean_kld=10.0))
    bound = compare_files(out["base"], out["cand"], Thresholds(max_mean_kld=10.0))
    tokens = [v for r in pq.read_table(out["paired"]).to_pylist() if r["token_kl"] for v in r["token_kl"][1:]]
    for c in (alone, pair):
        assert c.kl_label.startswith("exact")
        assert math.isclose(c.metrics.kld.mean, sum(tokens) / len(tokens), rel_tol=1e-12)
        assert c.passed
    assert math.isclose(alone.metrics.ppl_ratio, pair.metrics.ppl_ratio, rel_tol=1e-9)
    assert bound.kl_label.startswith("lower bound") and bound.metrics.kld.mean <= pair.metrics.kld.mean
    assert compare_files(out["paired"], None, Thresholds(max_mean_kld=1e-9)).passed is False
    default = next(ch for ch in compare_files(out["paired"], None, Thresholds.defaults()).checks
                   if ch.option == "--max-mean-kld")
    assert default.threshold == EXACT_MEAN_KLD and default.metric.endswith("exact")  # the exact figure's limit


def test_compare_cli_says_exact(runs):
    out, _ = runs
    res = runner.invoke(app, ["compare", str(out["paired"]), "--no-default-gate", "--max-mean-kld", "10"],
                        env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "exact" in res.output and "lower bound" not in res.output
    res = runner.invoke(app, ["compare", str(out["base"])], env={"COLUMNS": "200"})
    assert res.exit_code == 2 and "reference" in res.output
