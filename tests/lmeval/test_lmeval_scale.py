"""`apcscore eval` interrupted and resumed, split into shards and merged, on Ray, and with a results cache:
each must end with the results one uninterrupted process writes, bitwise (results.json's metrics, every column
of requests.parquet), and compute no response twice.

The four local tasks of tests/lmeval_tasks (multiple choice with few-shot examples, loglikelihood, rolling
perplexity, greedy generation), max_length 64, the default model in fp32 on the CPU.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

import pyarrow.parquet as pq  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from apcscore.cli import app  # noqa: E402

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TASKS = "apc_ll,apc_mc,apc_ppl,apc_gen"
TOTAL = 38  # engine-level responses of the four tasks: 5 + 6 x 4 + 5 rolling windows + 4 generations
ROWS = 36  # requests.parquet: lm-eval's requests (the 3 rolling texts one row each)


def run(*args, model=None) -> object:
    common = ["eval", "--tasks", TASKS, "--include-path", str(REPO / "tests" / "lmeval_tasks"), "--max-length",
              "64", "--dtype", "float32", "--device", "cpu", "--quiet", "--model", str(model)]
    return CliRunner().invoke(app, common + [str(a) for a in args])


def results(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


def assert_same_run(a: Path, b: Path) -> None:
    """Equal metrics (results.json's `results`, lm-eval's per-task numbers) and equal requests.parquet."""
    assert results(a)["results"] == results(b)["results"]
    ta, tb = pq.read_table(a / "requests.parquet"), pq.read_table(b / "requests.parquet")
    assert ta.num_rows == ROWS and ta.column_names == tb.column_names
    for name in ta.column_names:
        assert ta.column(name).equals(tb.column(name)), name


def journal_entries(folder: Path) -> int:
    (path,) = folder.glob("responses-*.jsonl")
    return sum(1 for line in path.read_text().splitlines()[1:] if line.strip())


@pytest.fixture(scope="module")
def model(default_model_dir) -> str:
    return str(default_model_dir)


@pytest.fixture(scope="module")
def whole(in_repo, model, tmp_path_factory) -> Path:
    """One uninterrupted process: what every other way must give."""
    out = tmp_path_factory.mktemp("whole") / "ev"
    result = run("--out", out, model=model)
    assert result.exit_code == 0, result.output
    assert results(out)["apcscore"]["responses"]["computed"] == TOTAL
    return out


def _interrupt_after(monkeypatch, outputs: int, signum: int) -> None:
    """The engine sends `signum` to this process once it has yielded `outputs` outputs (over all its calls)."""
    from apcscore.engine.engine import Engine

    original, seen = Engine.run, [0]

    def run_then_signal(self, requests, on_step=None):
        for out in original(self, requests, on_step):
            yield out
            seen[0] += 1
            if seen[0] == outputs:
                os.kill(os.getpid(), signum)

    monkeypatch.setattr(Engine, "run", run_then_signal)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupted_eval_resumes_to_the_uninterrupted_results(whole, model, tmp_path, monkeypatch, signum):
    out = tmp_path / "ev"
    with monkeypatch.context() as patch:
        _interrupt_after(patch, 12, signum)
        stopped = run("--out", out, model=model)
    assert stopped.exit_code == 130, stopped.output
    assert "--resume" in stopped.output and not (out / "results.json").exists()
    kept = journal_entries(out)
    assert 12 <= kept < TOTAL  # everything finished before the signal is on disk

    refused = run("--out", out, model=model)
    assert refused.exit_code == 2 and "--resume" in refused.output and "--overwrite" in refused.output
    if signum == signal.SIGINT:  # (once: the refusal loads the model first)
        other = run("--out", out, "--resume", "--num-fewshot", "1", model=model)
        assert other.exit_code == 2 and "num_fewshot" in other.output

    resumed = run("--out", out, "--resume", model=model)
    assert resumed.exit_code == 0, resumed.output
    counts = results(out)["apcscore"]["responses"]
    assert counts["read"] == kept and counts["computed"] == TOTAL - kept  # nothing computed twice
    assert_same_run(whole, out)


def test_shards_merge_to_one_process_s_results(whole, model, tmp_path):
    shards = [tmp_path / f"s{i}" for i in range(2)]
    computed = []
    for i, folder in enumerate(shards):
        result = run("--out", folder, "--shard", f"{i}/2", model=model)
        assert result.exit_code == 0, result.output
        assert not (folder / "results.json").exists()
        computed.append(json.loads((folder / "shard.json").read_text())["responses"]["computed"])
    assert sum(computed) == TOTAL and min(computed) > 0  # split, each request once

    missing = CliRunner().invoke(app, ["merge", str(tmp_path / "m"), str(shards[0])])
    assert missing.exit_code == 2 and "shards missing: 1/2" in missing.output
    merged = CliRunner().invoke(app, ["merge", str(tmp_path / "m"), *map(str, shards)])
    assert merged.exit_code == 0, merged.output
    counts = results(tmp_path / "m")["apcscore"]["responses"]
    assert counts["computed"] == 0 and counts["read"] == TOTAL
    assert_same_run(whole, tmp_path / "m")
    assert journal_entries(tmp_path / "m") == TOTAL  # the merged folder holds every response


def test_cache_reads_this_model_s_responses_only(whole, model, tiny_model_dir, tmp_path):
    cache = tmp_path / "cache"
    first = run("--out", tmp_path / "a", "--cache", cache, model=model)
    assert first.exit_code == 0, first.output
    again = run("--out", tmp_path / "b", "--cache", cache, "--exact-reuse", model=model)
    assert again.exit_code == 0, again.output
    counts = results(tmp_path / "b")["apcscore"]["responses"]
    assert counts == {**counts, "computed": 0, "read": TOTAL}
    assert_same_run(whole, tmp_path / "b")

    tiny = run("--out", tmp_path / "t", "--cache", cache, model=tiny_model_dir("llama"))
    assert tiny.exit_code == 0, tiny.output
    assert results(tmp_path / "t")["apcscore"]["responses"]["read"] == 0  # never another model's
    files = sorted(cache.glob("responses-*.jsonl"))
    assert len(files) == 2

    # a file of this configuration's name that holds another configuration's responses is refused
    mine = results(tmp_path / "b")["apcscore"]["responses"]["store"]
    other = next(f for f in files if f.name != mine)
    (cache / mine).write_text(other.read_text())
    refused = run("--out", tmp_path / "c", "--cache", cache, model=model)
    assert refused.exit_code == 2 and "another configuration" in refused.output


def test_shards_with_a_warm_cache_merge(whole, model, tmp_path):
    """A cache hit goes into the shard's journal too (issue 40): shards answered wholly from a warm --cache merge
    (before, the merge found "N of M requests have no response in the shards' stores")."""
    cache = tmp_path / "cache"
    assert run("--out", tmp_path / "warm", "--cache", cache, model=model).exit_code == 0
    shards = [tmp_path / f"s{i}" for i in range(2)]
    for i, folder in enumerate(shards):
        result = run("--out", folder, "--shard", f"{i}/2", "--cache", cache, model=model)
        assert result.exit_code == 0, result.output
        assert json.loads((folder / "shard.json").read_text())["responses"]["computed"] == 0
    merged = CliRunner().invoke(app, ["merge", str(tmp_path / "m"), *map(str, shards)])
    assert merged.exit_code == 0, merged.output
    assert_same_run(whole, tmp_path / "m")

@pytest.fixture(scope="module")
def cluster():
    """One local Ray cluster of 2 CPUs for the module's Ray tests (each would start its own with --ray local);
    `--ray auto` joins it."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.ray
def test_eval_on_ray_equals_one_process(whole, model, tmp_path, cluster):
    """Issue 41: `eval --ray` is one eval whose engine runs on replicas (run/ray_engine.RayEngine, the replicas of
    score's --ray): one journal, no shard folders, results bitwise one process's, each request run once."""
    out = tmp_path / "ray"
    result = run("--out", out, "--ray", "auto", "--replicas", "2", model=model)
    assert result.exit_code == 0, result.output
    meta = results(out)["apcscore"]
    assert meta["responses"]["computed"] == TOTAL and journal_entries(out) == TOTAL
    ran = [r["requests_run"] for r in meta["ray"]["per_replica"]]
    assert ran == [r["requests_assigned"] for r in meta["ray"]["per_replica"]] and min(ran) > 0  # split, once each
    assert meta["ray"]["replicas"] == 2 and not (out / "shards").exists()
    assert_same_run(whole, out)


def _interrupt_ray_after(monkeypatch, outputs: int) -> None:
    """The Ray engine sends SIGINT to this process once it has yielded `outputs` outputs."""
    from apcscore.run.ray_engine import RayEngine

    original, seen = RayEngine._outputs, [0]

    def outputs_then_signal(self, queues, on_step):
        for out in original(self, queues, on_step):
            yield out
            seen[0] += 1
            if seen[0] == outputs:
                os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(RayEngine, "_outputs", outputs_then_signal)


@pytest.mark.ray
def test_an_interrupted_ray_eval_resumes_with_or_without_ray(whole, model, tmp_path, monkeypatch, cluster):
    """`eval --ray` keeps the journal of one process: interrupted, it exits 130 with what finished on disk; a resume
    asked otherwise is refused naming the option; resumed without --ray (the same identity: the replicas' bits are
    this process's) it computes only what is missing and ends with one process's results."""
    out = tmp_path / "ray"
    with monkeypatch.context() as patch:
        _interrupt_ray_after(patch, 1)
        stopped = run("--out", out, "--ray", "auto", "--replicas", "2", model=model)
    assert stopped.exit_code == 130, stopped.output
    assert "--resume" in stopped.output and not (out / "results.json").exists()
    kept = journal_entries(out)
    assert 1 <= kept < TOTAL
    refused = run("--out", out, "--resume", "--limit", "1", model=model)
    text = " ".join(refused.output.split())
    assert refused.exit_code == 2 and "was asked otherwise" in text and "limit: null vs 1.0" in text, text
    resumed = run("--out", out, "--resume", model=model)
    assert resumed.exit_code == 0, resumed.output
    counts = results(out)["apcscore"]["responses"]
    assert counts["read"] == kept and counts["computed"] == TOTAL - kept  # nothing computed twice
    assert_same_run(whole, out)


def generation_killing_replica() -> type:
    """A replica whose process dies (as if killed for memory) on every chunk that holds a generation; made in a
    function so that Ray ships the class by value (workers cannot import this test module by its name)."""
    from apcscore.scale.replica import Replica

    class GenerationKillingReplica(Replica):
        def run_requests(self, requests):
            if any(r.sampling is not None for r in requests):
                os._exit(1)
            return super().run_requests(requests)

    return GenerationKillingReplica


@pytest.mark.ray
def test_a_ray_chunk_that_always_fails_ends_the_eval_and_keeps_the_rest(whole, model, tmp_path, monkeypatch,
                                                                         cluster):
    """A chunk that kills its replica on every retry ends `eval --ray` with exit 1 and a message that says what to
    do; the responses finished before it stay in the journal, so --resume computes only what is missing."""
    import apcscore.run.ray_replicas as replicas

    out = tmp_path / "ray"
    with monkeypatch.context() as patch:
        patch.setattr(replicas, "Replica", generation_killing_replica())
        failed = run("--out", out, "--ray", "auto", "--replicas", "2", model=model)
    text = " ".join(failed.output.split())
    assert failed.exit_code == 1, failed.output
    assert "--ray: a chunk of" in text and "failed 3 times on replica" in text and "--resume" in text, text
    kept = journal_entries(out)
    generations = 4  # apc_gen's: the only requests that fail
    assert kept == TOTAL - generations and not (out / "results.json").exists()
    resumed = run("--out", out, "--resume", "--ray", "auto", "--replicas", "2", model=model)
    assert resumed.exit_code == 0, resumed.output
    assert results(out)["apcscore"]["responses"]["computed"] == generations
    assert_same_run(whole, out)
