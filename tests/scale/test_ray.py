"""`--ray` (issue 17) on a local Ray cluster (ray.init(num_cpus=2)) with a tiny random model: 2 replicas write
bitwise the file one process writes; prefix-aware partitioning keeps the prefix-cache hit rate of one process
and random partitioning does not (so the hit-rate test can fail); a replica killed mid-run is restarted and the
file is still complete and exact. Skipped when Ray (the `ray` extra) is not installed."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from apcscore.cli import app
from apcscore.io.identity import NOT_BITS
from apcscore.scale.replica import Replica
from tests.scale.test_shard_merge import PROVENANCE, score_records, shared_prefix_records

try:
    import ray
except ImportError:  # pragma: no cover - the extra is installed by `make install`
    ray = None

pytestmark = [pytest.mark.ray,
              pytest.mark.skipif(ray is None, reason="Ray is not installed (pip install 'apcscore[ray]')")]
runner = CliRunner()


def run(*args) -> object:
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


@pytest.fixture(scope="module")
def cluster():
    """One local Ray cluster of 2 CPUs for the module; its workers inherit this process's environment."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def meta(path) -> dict:
    return json.loads(pq.read_schema(path).metadata[b"apcscore"])


def assert_same_rows(a_path, b_path, skip: tuple[str, ...] = ()) -> None:
    a, b = pq.read_table(a_path), pq.read_table(b_path)
    assert a.schema.remove_metadata().equals(b.schema.remove_metadata())
    for name in b.column_names:
        if name not in skip:
            assert a.column(name).equals(b.column(name)), name


@pytest.mark.slow
def test_two_replicas_equal_one_process(tmp_path, write_jsonl, tiny, cluster) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", score_records())
    common = ["score", data, "--model", tiny, "--num-kv-blocks", 256, "--prompt-logprobs", 2, "--skip-invalid", "-q"]
    single, two = tmp_path / "one.parquet", tmp_path / "two.parquet"
    assert run(*common, "--out", single).exit_code == 0
    res = run(*common, "--ray", "auto", "--replicas", 2, "--out", two)
    assert res.exit_code == 0, res.output
    assert_same_rows(two, single)
    m1, m2 = meta(single), meta(two)
    for m in (m1, m2):  # Ray gives a replica as many threads as CPUs (OMP_NUM_THREADS in blas.env), the probe's
        # timing differs: no bit does (the machine's description counts only for a library GEMM: io/identity.py)
        m["numerics"] = {k: v for k, v in m["numerics"].items()
                         if f"numerics.{k}" not in NOT_BITS and k not in ("hardware", "blas")}
    assert m2["numerics"]["batch_invariant"] is True
    assert {k: v for k, v in m2.items() if k not in PROVENANCE | {"ray"}} == \
        {k: v for k, v in m1.items() if k not in PROVENANCE}
    info = m2["ray"]
    assert info["replicas"] == 2 and len(info["per_replica"]) == 2
    assert all(r["records_run"] > 0 for r in info["per_replica"])  # both replicas worked
    invalid = 1  # the invalid record's error row is written by the driver
    assert sum(r["records_run"] for r in info["per_replica"]) + invalid == m1["dataset"]["num_records"]
    assert m2["timings"]["prompt_tokens"] == m1["timings"]["prompt_tokens"]


@pytest.mark.slow
def test_verify_reuse_runs_on_the_replicas(tmp_path, write_jsonl, tiny, cluster) -> None:
    """--verify-reuse under --ray (refused before issue 25): each replica re-scores its share of the seeded
    sample by recompute; the combined report covers what one process's covers, and the score store's counter
    reaches the file's timings (the old Ray driver dropped it)."""
    data = write_jsonl(tmp_path / "d.jsonl", shared_prefix_records())
    common = ["score", data, "--model", tiny, "--num-kv-blocks", 256, "--exact-reuse", "--verify-reuse", 1, "-q"]
    one, two = tmp_path / "one.parquet", tmp_path / "two.parquet"
    assert run(*common, "--out", one).exit_code == 0
    res = run(*common, "--ray", "auto", "--replicas", 2, "--out", two)
    assert res.exit_code == 0, res.output
    assert_same_rows(two, one)
    single, combined = meta(one)["verify_reuse"], meta(two)["verify_reuse"]
    assert combined["mismatches"] == [] and combined["records"] == single["records"] == 20
    assert combined["requests"] == single["requests"]
    assert meta(two)["timings"]["prefix_cache"]["score_store_hits"] > 0
    assert meta(one)["timings"]["prefix_cache"]["score_store_hits"] > 0


@pytest.mark.slow
def test_prefix_aware_partitioning_keeps_the_hit_rate_and_random_does_not(tmp_path, write_jsonl, tiny, cluster):
    data = write_jsonl(tmp_path / "g.jsonl", shared_prefix_records(groups=8, per_group=4, seed=11))
    common = ["generate", data, "--model", tiny, "--num-kv-blocks", 256, "--max-tokens", 2, "-q"]
    files = {k: tmp_path / f"{k}.parquet" for k in ("one", "prefix", "random")}
    assert run(*common, "--out", files["one"]).exit_code == 0
    for method in ("prefix", "random"):
        res = run(*common, "--ray", "auto", "--replicas", 2, "--partition", method, "--out", files[method])
        assert res.exit_code == 0, res.output
    rate = {k: meta(f)["timings"]["prefix_cache"]["hit_rate"] for k, f in files.items()}
    assert rate["one"] > 0.4, rate  # the workload shares prefixes at all
    assert abs(rate["prefix"] - rate["one"]) <= 0.1 * rate["one"], rate
    assert rate["random"] < 0.9 * rate["one"], rate
    # the completions do not depend on the split; num_cached_tokens is what the split changes
    for method in ("prefix", "random"):
        assert_same_rows(files[method], files["one"], skip=("num_cached_tokens",))


def _replica_pids() -> list[int]:
    """Processes of live Replica actors (Ray titles them `ray::Replica...`)."""
    import psutil

    pids = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info.get("cmdline") or [])
        if cmd.startswith("ray::Replica"):
            pids.append(proc.pid)
    return pids


SLOW = ["--num-kv-blocks", 256, "--prompt-logprobs", 1, "-q", "--max-num-seqs", 2, "--max-batch-tokens", 32]


@pytest.fixture(scope="module")
def slow_case(tmp_path_factory, tiny) -> tuple:
    """400 score records run slowly enough (2 sequences, 32 tokens a step) for a kill or an interrupt to land
    mid-run, and the single-process file they must equal."""
    from conftest import _write_jsonl

    folder = tmp_path_factory.mktemp("slow")
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    records = [{"id": f"r{i}", "prompt": " ".join(words[(i + j) % 10] for j in range(i % 29 + 4))} for i in range(400)]
    data = _write_jsonl(folder / "d.jsonl", records)
    single = folder / "one.parquet"
    assert run("score", data, "--model", tiny, *SLOW, "--out", single).exit_code == 0
    return data, single, [r["id"] for r in records]


def _when_rows_appear(partial, action) -> threading.Thread:
    """A thread that runs `action()` once the first part file of `partial` exists (replicas loaded and running)."""
    def watch() -> None:
        deadline = time.time() + 240
        while time.time() < deadline and not list(partial.glob("part-*.parquet")):
            time.sleep(0.2)
        action()

    thread = threading.Thread(target=watch)
    thread.start()
    return thread


@pytest.mark.slow
def test_a_replica_killed_mid_run_is_restarted_and_nothing_is_lost(tmp_path, tiny, cluster, slow_case) -> None:
    data, single, ids = slow_case
    out = tmp_path / "ray.parquet"
    killed: list[int] = []

    def kill() -> None:
        pids = _replica_pids()
        if pids:
            os.kill(pids[0], signal.SIGKILL)
            killed.append(pids[0])

    thread = _when_rows_appear(tmp_path / "ray.parquet.partial", kill)
    res = run("score", data, "--model", tiny, *SLOW, "--ray", "auto", "--replicas", 2, "--out", out)
    thread.join()
    assert res.exit_code == 0, res.output
    assert killed, "no replica process was found to kill"
    assert pq.read_table(out).column("id").to_pylist() == ids  # none lost, none twice
    assert_same_rows(out, single)
    pids = {r["pid"] for r in meta(out)["ray"]["per_replica"]}
    assert killed[0] not in pids  # the stats come from the restarted process


@pytest.mark.slow
def test_interrupt_then_resume_on_ray_equals_one_process(tmp_path, tiny, cluster, slow_case) -> None:
    data, single, ids = slow_case
    out, partial = tmp_path / "ray.parquet", tmp_path / "ray.parquet.partial"
    common = ["score", data, "--model", tiny, *SLOW, "--ray", "auto", "--replicas", 2, "--out", out]
    thread = _when_rows_appear(partial, lambda: os.kill(os.getpid(), signal.SIGINT))
    res = run(*common)
    thread.join()
    assert res.exit_code == 130, res.output
    saved = sum(pq.read_metadata(p).num_rows for p in partial.glob("part-*.parquet"))
    assert 0 < saved < len(ids) and not out.exists()
    res = run(*common, "--resume")
    assert res.exit_code == 0, res.output
    assert pq.read_table(out).column("id").to_pylist() == ids
    assert_same_rows(out, single)
    assert meta(out)["sessions"] == 2


def test_a_replica_that_refuses_the_run_is_one_clear_error(tmp_path, cluster) -> None:
    """An ApcscoreError raised in a replica's constructor comes back as one message, not Ray's traceback. (The
    replica is built directly here, with a model path its node does not have, as on a cluster whose nodes do
    not share the driver's files; the options object refuses bad settings before any replica exists.)"""
    from apcscore.errors import ApcscoreError
    from apcscore.options.commands import ScoreOptions
    from apcscore.run.ray_replicas import ray_get
    from apcscore.scale.replica import Replica

    opts = ScoreOptions(model=str(tmp_path / "no-such-model"))
    actor = ray.remote(Replica).options(num_cpus=1, max_restarts=-1, max_task_retries=-1).remote(opts)
    with pytest.raises(ApcscoreError, match=r"^a Ray replica refused the run: Unknown model '.*no-such-model': "
                                            r"no such alias"):
        ray_get(ray, actor.describe.remote())
    ray.kill(actor)


def poison_replica() -> type:
    """A replica whose process dies (as if killed for memory) on every chunk that holds the record "poison"; made
    in a function so that Ray ships the class by value (workers cannot import this test module by its name)."""

    class PoisonReplica(Replica):
        def run_requests(self, requests):
            if any(r.request_id[0] == 5 for r in requests):  # a request of the record "poison" (dataset position 5)
                os._exit(1)
            return super().run_requests(requests)

    return PoisonReplica


@pytest.mark.slow
def test_a_chunk_that_kills_its_worker_every_time_fails_the_run_and_keeps_the_rest(tmp_path, write_jsonl, tiny,
                                                                                   cluster, monkeypatch) -> None:
    import apcscore.run.ray_replicas as ray_run

    records = [{"id": f"r{i}", "prompt": f"record number {i} of the set"} for i in range(12)]
    records[5]["id"] = "poison"
    data = write_jsonl(tmp_path / "d.jsonl", records)
    out = tmp_path / "ray.parquet"
    monkeypatch.setattr(ray_run, "Replica", poison_replica())
    started = time.time()
    res = run("score", data, "--model", tiny, "--num-kv-blocks", 64, "-q", "--partition", "random", "--ray", "auto",
              "--replicas", 2, "--out", out)
    text = " ".join(res.output.split())
    assert res.exit_code == 1, res.output
    assert time.time() - started < 600  # bounded retries: it ends
    assert "records were not run" in text and "poison" in text and "a Ray replica failed" in text
    assert "--resume" in text and not out.exists()
    parts = sorted((tmp_path / "ray.parquet.partial").glob("part-*.parquet"))
    saved = [i for p in parts for i in pq.read_table(p).column("id").to_pylist()]
    assert saved and "poison" not in saved and len(saved) < len(records)  # the other replica's rows are kept
    monkeypatch.setattr(ray_run, "Replica", Replica)  # without the fault, --resume runs what is missing
    res = run("score", data, "--model", tiny, "--num-kv-blocks", 64, "-q", "--partition", "random", "--ray", "auto",
              "--replicas", 2, "--out", out, "--resume")
    assert res.exit_code == 0, res.output
    assert pq.read_table(out).column("id").to_pylist() == [r["id"] for r in records]


def test_resources_the_cluster_does_not_have_are_refused_not_waited_for(tmp_path, write_jsonl, tiny, cluster) -> None:
    """Issue 46, item 7: `--gpus-per-replica 1` on a cluster without a GPU waited forever, without a word (the
    actor is never placed). One replica's resources are checked against the cluster's before any starts."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Hello"}])
    out = tmp_path / "o.parquet"
    for args, message in ((["--gpus-per-replica", 1],
                           "--gpus-per-replica 1: the Ray cluster has 0 GPUs in all (CPU 2)"),
                          (["--cpus-per-replica", 3], "--cpus-per-replica 3: the Ray cluster has 2 CPUs in all")):
        res = run("score", data, "--model", tiny, "--ray", "auto", *args, "--out", out, "-q")
        assert res.exit_code == 2 and "Traceback" not in res.output, res.output
        assert message in " ".join(res.output.split()) and not out.exists()


def vendor_replica(marker: str) -> type:
    """A replica that describes its CPU as an Intel one when it is the first to claim the file `marker`, else as an
    AMD one (a cluster of two kinds of node); made in a function so that Ray ships the class by value."""

    class VendorReplica(Replica):
        def describe(self):
            desc = super().describe()
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
                vendor = "GenuineIntel"
            except FileExistsError:
                vendor = "AuthenticAMD"
            desc["metadata"]["numerics"]["hardware"]["cpu"] = {"vendor": vendor, "model": f"{vendor} CPU"}
            return desc

    return VendorReplica


@pytest.mark.slow
def test_replicas_of_two_cpu_vendors_are_refused_where_the_gemm_is_a_library_one(tmp_path, write_jsonl, tiny,
                                                                                 cluster, monkeypatch) -> None:
    """Issue 40: with --no-batch-invariant the CPU decides a library GEMM's bits, so an Intel and an AMD replica
    cannot write one file; with the fixed-order GEMM (portable bits) they can."""
    import apcscore.run.ray_replicas as ray_run

    data = write_jsonl(tmp_path / "d.jsonl", [{"id": f"r{i}", "prompt": f"record number {i}"} for i in range(6)])
    for name, options in (("library", ["--no-batch-invariant"]), ("portable", [])):
        monkeypatch.setattr(ray_run, "Replica", vendor_replica(str(tmp_path / f"{name}.claimed")))
        out = tmp_path / f"{name}.parquet"
        res = run("score", data, "--model", tiny, "--num-kv-blocks", 64, "-q", "--ray", "auto", "--replicas", 2,
                  "--out", out, *options)
        text = " ".join(res.output.split())
        if name == "library":
            assert res.exit_code == 2 and "replica 1 does not run the configuration of replica 0" in text, text
            assert "numerics.hardware.cpu" in text and not out.exists()
        else:
            assert res.exit_code == 0, res.output
            assert pq.read_table(out).num_rows == 6
