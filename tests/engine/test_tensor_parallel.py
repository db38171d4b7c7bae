"""Tensor parallelism (issue 29) on the CPU: gloo, 2 ranks (4 in the last test), tiny random models.

- degree 2 against degree 1: fp32 logprobs within 1e-5, ranks and top-K ids equal but at near-ties, for the
  Llama-family variants (untied / tied head, q/k norms, qkv bias, Phi-3's fused checkpoint, one KV head replicated
  on both ranks), Gemma 2 (soft-caps), OLMo 2 (q/k norms over all heads), GPT-NeoX (per-head fused qkv, biases,
  parallel residual) and Qwen2-MoE (experts split, a shared expert, a dense layer, qkv bias);
- the batch-invariance matrix of tests/engine/test_invariance.py (alone, batches, shuffled, warm cache, budgets,
  preemption, one thread) at degree 2, every column exact;
- the vocabulary-parallel logprobs against the one-device definition on logits full of ties (ranks, top-K across
  shard boundaries and the K-th place), the ranks simulated by threads;
- exact reuse and the score store at degree 2, bitwise a recompute;
- sharded loading reads only this rank's slices of the sharded weights, and they are the right ones;
- the refusals before any load, the metadata's degree and merge refusing mixed degrees;
- a rank killed mid-run: one clear error, the finished rows kept, --resume bitwise an uninterrupted run;
- issue 42: Ctrl-C and a group SIGTERM stop a run gracefully (exit 130), a worker outlives no rank 0, torchrun's
  ranks take cuda:LOCAL_RANK first, failures while profiling or on a worker end no run in a hang, a refused engine
  frees the workers' shards, rank 0's thread share, the start timeout, gloo on the loopback interface;
- degree 4 (four partial sums: where their order matters): against degree 1, and exact across order and preemption
  (last: it leaves the module's group at degree 4).

The ranks start once for the module (the process keeps its group; engines after the first reuse it) and stop at
its end.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

from apcscore import Engine, EngineConfig, Request, SamplingParams
from apcscore.engine.loader import load_native_engine, native_engine_from_parts
from apcscore.errors import ApcscoreError

from test_invariance import Matrix, assert_same, make_prompts, run, score_requests

BASE = dict(device="cpu", dtype="float32", num_kv_blocks=512, max_num_seqs=16, max_batch_tokens=512)  # (a short probe)


@pytest.fixture(scope="module", autouse=True)
def ranks():
    """Stop this process's ranks after the module (they start with its first degree-2 engine)."""
    yield
    from apcscore.engine.parallel.ranks import shutdown_ranks

    shutdown_ranks()


@pytest.fixture(scope="module")
def mqa_dir(tmp_path_factory, default_tokenizer):
    """A tiny Llama with one KV head: at degree 2 each rank holds a replica of it."""
    from conftest import build_tiny_model

    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-mqa"), default_tokenizer,
                            {"num_key_value_heads": 1})


def _scores(engine: Engine, requests: list[Request]) -> dict:
    out = {}
    for o in engine.run(requests):
        assert o.error is None, o.error
        out[o.request_id] = o
    return out


# one model per mechanism (CI time; Qwen2-MoE has Qwen2's qkv bias): Qwen2, Gemma 3 (windows) and Mixtral (fp32
# routing weights) pass too, run once: max |d logprob| 5.7e-6, 6.7e-6 and 5.7e-6
# (mqa: an untied Llama)
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mqa", "qwen3", "phi3", "gemma2", "olmo2", "neox", "qwen2_moe"])
def test_degree_2_agrees_with_degree_1(tiny_model_dir, mqa_dir, arch: str) -> None:
    """Logprobs within 1e-5 (the o / down sums split along K round differently); ranks and top-K ids equal but
    where two logits lie within that rounding of each other."""
    path = str(mqa_dir if arch == "mqa" else tiny_model_dir(arch))
    requests = score_requests(make_prompts([1, 33, 100], 49152, seed=11))
    one = _scores(load_native_engine(path, EngineConfig(**BASE)), requests)
    two = _scores(load_native_engine(path, EngineConfig(**BASE, tensor_parallel_size=2)), requests)
    worst, rank_moves, positions = 0.0, 0, 0
    for rid, a in one.items():
        pa, pb = a.prompt_logprobs, two[rid].prompt_logprobs
        assert np.array_equal(pa.token_ids, pb.token_ids) and np.array_equal(pa.positions, pb.positions)
        if len(pa.token_logprobs):
            worst = max(worst, float(np.abs(pa.token_logprobs - pb.token_logprobs).max()),
                        float(np.abs(pa.top_logprobs - pb.top_logprobs).max()))
        # a rank counts logits strictly above the target's: among 49,152 random logits a neighbour within the
        # 1e-6 that the degrees differ by sometimes swaps sides (measured: 0-6 of ~280 positions, by 1 or 2). The
        # definition itself is checked exactly on shared logits (test_vocab_parallel_logprobs_match_one_device_on_ties)
        moved = pa.ranks != pb.ranks
        rank_moves += int(moved.sum())
        positions += moved.size
        assert np.abs(pa.ranks - pb.ranks).max(initial=0) <= 3, rid
        assert np.array_equal(pa.top_ids, pb.top_ids), rid  # (no near-tie in these top-5s)
    print(f"{arch}: degree 2 vs 1 max |d logprob| {worst:.2e}, ranks moved at {rank_moves} of {positions}")
    assert rank_moves <= 0.05 * positions
    assert 0 < worst <= 1e-5  # 0 would mean degree 2 ran the degree-1 path


def test_a_state_dict_gives_the_bits_of_a_directory(tiny_model_dir) -> None:
    """native_engine_from_parts at degree 2 (the state dict sent to every rank, sliced there) gives bitwise what the
    directory (each rank reading its safetensors slices) gives."""
    from apcscore.models.loading import load_config, load_state_dict, load_tokenizer

    path = tiny_model_dir("qwen2")
    config = EngineConfig(**BASE, tensor_parallel_size=2)
    requests = score_requests(make_prompts([3, 40], 49152, seed=14))
    from_dir = run(load_native_engine(str(path), config), requests)
    parts = native_engine_from_parts(load_config(path), load_state_dict(path), load_tokenizer(path), config)
    assert_same(run(parts, requests), from_dir, "state dict")


def test_exact_reuse_and_the_score_store_at_degree_2(tiny_model_dir) -> None:
    """--exact-reuse at degree 2 (cached context blocks read, stored scores served, boundary rows scored from stored
    hidden states broadcast to every rank), in chunks of 57 tokens: bitwise a full recompute at degree 2."""
    from test_score_store import shared_prefix_requests

    path = str(tiny_model_dir("llama"))
    requests = shared_prefix_requests(n=4)
    want = run(load_native_engine(path, EngineConfig(**BASE, tensor_parallel_size=2)), requests)
    reuse = load_native_engine(path, EngineConfig(**{**BASE, "max_batch_tokens": 57}, exact_reuse=True,
                                                  tensor_parallel_size=2))
    assert_same(run(reuse, requests), want, "exact reuse")
    assert reuse.block_manager.stats.score_store_hits > 0


@pytest.mark.slow
def test_degree_2_scores_are_batch_invariant(tiny_model_dir) -> None:
    """tests/engine/test_invariance.py's matrix at degree 2 (fewer lengths and budgets than degree 1's, for CI time)."""
    matrix = Matrix(str(tiny_model_dir("qwen3")), "float32", tensor_parallel_size=2, num_kv_blocks=512,
                    max_batch_tokens=512)
    prompts = make_prompts([1, 17, 70, 333], 49152, seed=3)
    matrix.check(score_requests, prompts, (1, 57, 4096), long_budget_limit=17)


@pytest.mark.slow
def test_degree_2_generation_is_batch_invariant(tiny_model_dir) -> None:
    """Seeded sampling with logprobs (the gathered sampling logits) under the same matrix."""
    from test_invariance import generate_requests

    matrix = Matrix(str(tiny_model_dir("llama")), "float32", tensor_parallel_size=2, num_kv_blocks=512,
                    max_batch_tokens=512)
    prompts = make_prompts([1, 17, 90, 300], 49152, seed=5, shared=40)  # (300: the tight pool preempts)
    matrix.check(lambda p: generate_requests(p, True), prompts, (1, 4096), long_budget_limit=17)


class ThreadRanks:
    """In-process ranks for engine/parallel/logprobs (threads meeting at a barrier): the combination logic tested
    without processes."""

    def __init__(self, n: int) -> None:
        self.n, self.slots, self.barrier = n, [None] * n, threading.Barrier(n)

    def rank(self, r: int):
        owner = self

        class One:
            rank, world_size = r, owner.n

            def gather(self, x: torch.Tensor) -> list[torch.Tensor]:
                owner.slots[r] = x.clone()
                owner.barrier.wait()
                parts = list(owner.slots)
                owner.barrier.wait()
                return parts

        return One()


@pytest.mark.parametrize("n", [2, 3])
def test_vocab_parallel_logprobs_match_one_device_on_ties(n: int) -> None:
    """Integer logits (many ties, across shard boundaries and across the K-th place): ranks and top-K ids are
    exactly the one-device function's, logprobs within fp32 rounding."""
    from apcscore.engine.parallel.logprobs import parallel_token_logprobs
    from apcscore.kernels.logprobs_torch import token_logprobs_torch
    from apcscore.models.tensor_parallel import vocab_range

    gen = torch.Generator().manual_seed(0)
    vocab, rows, k = 50, 7, 6
    logits = torch.randint(0, 5, (rows, vocab), generator=gen).float()  # [7, 50]
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    want = token_logprobs_torch(logits, targets, k)
    group, results = ThreadRanks(n), [None] * n

    def run(r: int) -> None:
        start, end = vocab_range(vocab, r, n)
        results[r] = parallel_token_logprobs(group.rank(r), lambda h: h[:, start:end], logits, targets, k,
                                             chunk_size=3, ranks=True, start=start, vocab=vocab)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got in results:
        assert np.array_equal(got.ranks, want[1].numpy())
        assert np.array_equal(got.top_ids, want[2].numpy())
        np.testing.assert_allclose(got.token_logprobs, want[0].numpy(), atol=1e-6)
        np.testing.assert_allclose(got.top_logprobs, want[3].numpy(), atol=1e-6)


def test_a_rank_reads_only_its_slices(tiny_model_dir, monkeypatch) -> None:
    """Rank 1 of 2 reads the sharded projections through safetensors slices (no whole tensor), and holds exactly
    its rows / columns of the full weights."""
    from apcscore.models.decoders import build_decoder
    from apcscore.models.loading import LazyCheckpoint, load_config, load_state_dict
    from apcscore.models.ops import select_ops
    from apcscore.models.tensor_parallel import TensorParallel

    path = tiny_model_dir("llama")
    whole: list[str] = []
    read = LazyCheckpoint.__getitem__
    monkeypatch.setattr(LazyCheckpoint, "__getitem__", lambda self, name: (whole.append(name), read(self, name))[1])
    cfg = load_config(path)
    model = build_decoder(cfg, select_ops("torch"), 256, "cpu", torch.float32, LazyCheckpoint(path),
                          tp=TensorParallel(1, 2))
    assert whole and not [n for n in whole if n.endswith("proj.weight") or n in ("lm_head.weight",
                                                                                 "model.embed_tokens.weight")], whole
    full = load_state_dict(path)
    attn, mlp = model.layers[1].self_attn, model.layers[1].mlp
    p = "model.layers.1."
    q, k, v = (full[p + f"self_attn.{x}_proj.weight"] for x in "qkv")  # 4 query heads, 2 KV heads, head_dim 16
    assert torch.equal(attn.qkv_proj.weight, torch.cat([q[32:64], k[16:32], v[16:32]]))
    assert torch.equal(attn.o_proj.weight, full[p + "self_attn.o_proj.weight"][:, 32:64])
    gate, up = full[p + "mlp.gate_proj.weight"], full[p + "mlp.up_proj.weight"]
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([gate[64:], up[64:]]))
    assert torch.equal(mlp.down_proj.weight, full[p + "mlp.down_proj.weight"][:, 64:])
    assert torch.equal(model.lm_head_weight, full["lm_head.weight"][24576:])
    assert torch.equal(model.embed_tokens.weight, full["model.embed_tokens.weight"][24576:])


def test_refusals_before_any_load(tiny_model_dir) -> None:
    from apcscore.engine.loader import load_engine
    from apcscore.engine.parallel.ranks import check_devices

    with pytest.raises(ApcscoreError, match="does not divide the model's 4 attention heads"):
        load_native_engine(str(tiny_model_dir("llama")), EngineConfig(**BASE, tensor_parallel_size=3))
    with pytest.raises(ApcscoreError, match="needs the native engine"):
        EngineConfig(model_backend="transformers", tensor_parallel_size=2)
    with pytest.raises(ApcscoreError, match="needs the native engine, and gpt2 runs through the transformers"):
        load_engine(str(tiny_model_dir("gpt2")), EngineConfig(**BASE, tensor_parallel_size=2))
    if torch.cuda.device_count() < 4:
        with pytest.raises(ApcscoreError, match=r"needs 4 CUDA devices \(one per rank\)"):
            check_devices(4, torch.device("cuda"))


def test_cli_records_the_degree_and_merge_refuses_mixed_degrees(tmp_path, write_jsonl, tiny_model_dir) -> None:
    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from apcscore.cli import app

    data = write_jsonl(tmp_path / "d.jsonl", [{"id": str(i), "prompt": "the quick brown fox " * (i + 1)}
                                              for i in range(4)])
    model = str(tiny_model_dir("llama"))
    outs = []
    for shard, degree in (("0/2", "2"), ("1/2", "1")):
        out = tmp_path / f"s{shard[0]}.parquet"
        res = CliRunner().invoke(app, ["score", str(data), "--model", model, "--out", str(out), "--quiet",
                                       "--shard", shard, "--tensor-parallel", degree, "--num-kv-blocks", "256"])
        assert res.exit_code == 0, res.output
        meta = json.loads(pq.read_table(out).schema.metadata[b"apcscore"])
        assert meta["engine"]["tensor_parallel_size"] == int(degree)
        outs.append(str(out))
    res = CliRunner().invoke(app, ["merge", str(tmp_path / "m.parquet"), *outs])
    assert res.exit_code == 2 and "tensor_parallel_size" in " ".join(res.output.split()), res.output


def test_a_rank_that_dies_ends_the_run_and_keeps_the_finished_rows(tmp_path, write_jsonl, tiny_model_dir,
                                                                   monkeypatch) -> None:
    """The worker is killed at the 4th step: a clear error (exit 1), the finished rows kept; --resume (on fresh
    ranks) completes the file, bitwise what one uninterrupted degree-2 run writes."""
    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from apcscore.cli import app
    from apcscore.engine.parallel.ranks import current_group
    from apcscore.engine.parallel.runner import SliceRunner

    data = write_jsonl(tmp_path / "d.jsonl", [{"id": str(i), "prompt": "the quick brown fox " * (i + 1)}
                                              for i in range(10)])
    args = ["--model", str(tiny_model_dir("llama")), "--quiet", "--tensor-parallel", "2", "--max-batch-tokens",
            "32", "--max-num-seqs", "2", "--num-kv-blocks", "256", "--prompt-logprobs", "2"]
    whole = tmp_path / "whole.parquet"
    assert CliRunner().invoke(app, ["score", str(data), "--out", str(whole), *args]).exit_code == 0
    steps = {"n": 0}
    forward = SliceRunner._forward

    def dying(self, batch):  # type: ignore[no-untyped-def]
        steps["n"] += 1
        if steps["n"] == 4:
            for proc in current_group().processes:
                proc.kill()
                proc.join()
        return forward(self, batch)

    monkeypatch.setattr(SliceRunner, "_forward", dying)
    out = tmp_path / "o.parquet"
    res = CliRunner().invoke(app, ["score", str(data), "--out", str(out), *args])
    assert res.exit_code == 1, res.output
    assert "a tensor-parallel rank ended or stopped answering" in " ".join(res.output.split()), res.output
    assert "Traceback" not in res.output
    kept = sum(pq.read_table(part).num_rows for part in (tmp_path / "o.parquet.partial").glob("*.parquet"))
    assert 0 < kept < 10
    monkeypatch.setattr(SliceRunner, "_forward", forward)
    res = CliRunner().invoke(app, ["score", str(data), "--out", str(out), "--resume", *args])
    assert res.exit_code == 0, res.output
    a, b = pq.read_table(whole), pq.read_table(out)
    for name in ("id", "token_logprobs", "token_ranks", "top_ids", "top_logprobs", "sum_logprob"):
        assert a.column(name).to_pylist() == b.column(name).to_pylist(), name


def test_a_failure_on_rank_0_mid_step_does_not_leave_the_ranks_waiting(tiny_model_dir, monkeypatch) -> None:
    """Rank 0 fails after the workers were told to score (they wait in a gather it never joins): the error
    propagates, and the next engine ends those ranks and starts fresh ones at once instead of waiting for them."""
    import time

    from apcscore.engine.parallel import runner as tp_runner

    path = str(tiny_model_dir("llama"))
    requests = score_requests(make_prompts([5, 30], 49152, seed=15))
    want = run(load_native_engine(path, EngineConfig(**BASE, tensor_parallel_size=2)), requests)

    def boom(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("boom")

    monkeypatch.setattr(tp_runner, "parallel_token_logprobs", boom)
    with pytest.raises(RuntimeError, match="boom"):
        run(load_native_engine(path, EngineConfig(**BASE, tensor_parallel_size=2)), requests)
    monkeypatch.undo()
    started = time.perf_counter()
    assert_same(run(load_native_engine(path, EngineConfig(**BASE, tensor_parallel_size=2)), requests), want, "after")
    assert time.perf_counter() - started < 30


# ---------------------------------------------------------------- issue 42: signals, devices, hangs, cleanup

@pytest.mark.slow
@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
def test_ctrl_c_or_a_group_sigterm_stops_a_degree_2_run_gracefully(tmp_path, write_jsonl, tiny_model_dir,
                                                                  signum: str) -> None:
    """Issue 42 item 7: Ctrl-C (SIGINT to the terminal's process group) or a process-group SIGTERM reached the
    spawned ranks too, which died mid-step, so the graceful stop ended as "a rank ended" (exit 1), not 130."""
    import os
    import signal
    import subprocess
    import sys
    import time

    data = write_jsonl(tmp_path / "d.jsonl", [{"id": str(i), "prompt": "the quick brown fox " * (i % 7 + 1)}
                                              for i in range(400)])
    out = tmp_path / "o.parquet"
    proc = subprocess.Popen([sys.executable, "-m", "apcscore", "score", str(data), "--model",
                             str(tiny_model_dir("llama")), "--tensor-parallel", "2", "--max-num-seqs", "1",
                             "--max-batch-tokens", "16", "--out", str(out), "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    partial = tmp_path / "o.parquet.partial"
    deadline = time.time() + 120
    while not any(partial.glob("part-*.parquet")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    os.killpg(proc.pid, getattr(signal, signum))  # as the terminal's Ctrl-C, or `kill -TERM -PGID`
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output
    assert "interrupted:" in output and "rank ended" not in output, output


@pytest.mark.slow
def test_a_worker_whose_rank_0_is_killed_exits_by_itself(tmp_path, tiny_model_dir) -> None:
    """Issue 42 item 7: the workers now ignore SIGTERM (rank 0 stops the group), so one whose rank 0 is gone
    (here a process-group SIGTERM, which kills rank 0 before it has a handler) must not wait in a collective
    until the timeout: it exits within seconds."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    script = tmp_path / "rank0.py"
    script.write_text(
        "import sys, time\n"
        "from apcscore import EngineConfig\n"
        "from apcscore.engine.loader import load_native_engine\n"
        "from apcscore.engine.parallel.ranks import current_group\n"
        "if __name__ == '__main__':\n"
        f"    load_native_engine(sys.argv[1], EngineConfig(**{BASE!r}, tensor_parallel_size=2))\n"
        "    print('workers', *[p.pid for p in current_group().processes], flush=True)\n"
        "    time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, str(script), str(tiny_model_dir("llama"))], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    line = proc.stdout.readline()
    assert line.startswith("workers "), line
    (worker,) = map(int, line.split()[1:])
    os.killpg(proc.pid, signal.SIGTERM)  # the workers ignore it; rank 0 has no handler at this point: it dies
    proc.wait(timeout=30)

    def running(pid: int) -> bool:
        status = Path(f"/proc/{pid}/status")
        return status.exists() and "\nState:\tZ" not in status.read_text()

    deadline = time.time() + 20
    while running(worker) and time.time() < deadline:
        time.sleep(0.2)
    assert not running(worker)


def test_a_worker_ignores_stop_signals_and_exits_once_its_parent_is_gone() -> None:
    """Issue 42 item 7, the mechanism itself: on gloo a worker whose rank 0 died also ends because its socket
    closes (the test above passes without the parent watch), but on NCCL it would wait in a collective until the
    timeout. Here a process that runs the worker's first lines (ignore_stop_signals, watch_parent) and then only
    sleeps: SIGINT and SIGTERM leave it running, and it exits within seconds once its parent is SIGKILLed."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    child = ("import os, time\n"
             "from apcscore.engine.parallel.spawn import ignore_stop_signals, watch_parent\n"
             "ignore_stop_signals()\n"
             "watch_parent(os.getppid())\n"
             "print('ready', flush=True)\n"
             "time.sleep(600)\n")
    parent = ("import subprocess, sys, time\n"
              f"proc = subprocess.Popen([sys.executable, '-c', {child!r}], stdout=subprocess.PIPE, text=True)\n"
              "assert proc.stdout.readline() == 'ready\\n'\n"
              "print(proc.pid, flush=True)\n"
              "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    worker = int(proc.stdout.readline())

    def running(pid: int) -> bool:
        status = Path(f"/proc/{pid}/status")
        return status.exists() and "\nState:\tZ" not in status.read_text()

    try:
        for signum in (signal.SIGINT, signal.SIGTERM):
            os.kill(worker, signum)
        time.sleep(1.0)
        assert running(worker), "a worker ended on SIGINT/SIGTERM (rank 0 alone stops the group)"
        proc.kill()  # rank 0 gone without a word
        proc.wait(timeout=30)
        deadline = time.time() + 20  # PARENT_POLL_SECONDS is 1 s
        while running(worker) and time.time() < deadline:
            time.sleep(0.2)
        assert not running(worker), "the worker outlived its parent"
    finally:
        if running(worker):
            os.kill(worker, signal.SIGKILL)


def test_under_torchrun_with_nccl_each_rank_takes_its_local_gpu_before_the_first_collective(monkeypatch) -> None:
    """Issue 42 item 8: under torchrun with NCCL the ranks never called set_device(LOCAL_RANK) before the first
    collective, so every one of them used cuda:0. (No GPU needed: the calls are recorded in order.)"""
    import torch.distributed as dist

    from apcscore.engine.parallel import ranks as tensor_parallel

    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: events.append(f"set_device {d}"))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: events.append(f"init {backend}"))
    monkeypatch.setattr(tensor_parallel, "serve", lambda tp: events.append(f"serve rank {tp.rank}"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "3")  # a worker on a second node: its GPU is its local rank
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(SystemExit):
        tensor_parallel.serve_if_worker(torch.device("cuda"))
    assert events == ["set_device 1", "init nccl", "serve rank 3"]
    events.clear()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(tensor_parallel, "_GROUP", None)
    group = tensor_parallel.rank_group(2, torch.device("cuda"))
    monkeypatch.setattr(tensor_parallel, "_GROUP", None)  # (nothing to shut down: no process was started)
    group.watch.stop()  # (NCCL's failure watch)
    assert events == ["set_device 0", "init nccl"] and group.backend == "nccl" and not group.processes


def test_a_failure_while_profiling_marks_the_group_out_of_step(monkeypatch) -> None:
    """Issue 42 item 9: RankSlice.profile (CUDA pool sizing) was not guarded as a step is: an out-of-memory on rank 0
    left the workers in the profile's gather, and the shutdown broadcast waited for them until the 30-minute
    timeout. Now the group is marked, so the next engine or the exit ends them at once."""
    from apcscore.engine.parallel import runner as tp_runner
    from apcscore.models.tensor_parallel import TensorParallel

    class Group:
        def __init__(self) -> None:
            self.in_sync, self.calls = True, []

        def call(self, key, op, *args):  # type: ignore[no-untyped-def]
            self.calls.append(op)

    def oom(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(tp_runner, "profile_peak_memory", oom)
    shard, group = tp_runner.RankSlice(TensorParallel(0, 2), None, None, torch.device("cpu"), torch.float32), Group()
    with pytest.raises(torch.OutOfMemoryError):
        shard.profile({"max_batch_tokens": 8}, group, 1)
    assert group.calls == ["profile"] and group.in_sync is False


def test_an_engine_refused_after_loading_frees_the_workers_shards(tiny_model_dir) -> None:
    """Issue 42 item 10: a refusal between the load and make_runner (here the KV pool check) left the workers'
    shards of that engine alive for the rest of the process. Now they are dropped with the next call."""
    from apcscore.engine.parallel.ranks import current_group

    path = str(tiny_model_dir("llama"))
    requests = score_requests(make_prompts([5, 9], 49152, seed=3))
    engine = load_native_engine(path, EngineConfig(**BASE, tensor_parallel_size=2))  # (the group is running)
    group = current_group()
    key = group.next_key
    with pytest.raises(ApcscoreError, match="the KV pool of"):
        load_native_engine(path, EngineConfig(**{**BASE, "num_kv_blocks": 10**12}, tensor_parallel_size=2))
    assert key in group.dropped
    run(engine, requests)  # the drop travels with the next call, and the ranks stay in step
    assert key not in group.dropped


def test_rank_0_takes_its_share_of_the_threads_while_the_ranks_run(tiny_model_dir) -> None:
    """Issue 42 item 11: the workers got threads / N but rank 0 kept them all (N ranks oversubscribed the cores).
    Rank 0 takes its share while the group runs and gets its count back at shutdown."""
    from apcscore.engine.parallel.ranks import shutdown_ranks

    shutdown_ranks()  # a fresh group, started from this thread count
    before = torch.get_num_threads()
    try:
        load_native_engine(str(tiny_model_dir("llama")), EngineConfig(**BASE, tensor_parallel_size=2))
        assert torch.get_num_threads() == max(1, before // 2)
    finally:
        shutdown_ranks()
    assert torch.get_num_threads() == before


def test_a_rank_that_never_starts_is_refused_after_the_start_timeout() -> None:
    """Issue 42 item 11: waiting for the spawned ranks to start had no timeout (a rank stuck before apcscore's
    code, e.g. swapping, kept rank 0 waiting for ever)."""
    import threading
    import time

    from apcscore.engine.parallel import spawn as tp_spawn

    class Stuck:  # a process that stays alive and never signals it is ready
        pid, exitcode, killed = 4242, None, False

        def is_alive(self) -> bool:
            return not self.killed

        def kill(self) -> None:
            self.killed = True

    proc, started = Stuck(), time.monotonic()
    with pytest.raises(ApcscoreError, match=r"tensor-parallel rank 1 did not start within 0.2 s") as refused:
        tp_spawn.wait_ready([proc], [threading.Event()], timeout=0.2)
    assert refused.value.exit_code == 1 and proc.killed and time.monotonic() - started < 5


@pytest.mark.slow
def test_spawned_ranks_talk_over_the_loopback_interface(tiny_model_dir, monkeypatch) -> None:
    """Issue 42 item 11: gloo listened on the interface the host name resolves to, though every spawned rank is
    local. The ranks start with GLOO_SOCKET_IFNAME = the loopback interface (rank 0's environment is left as
    it was); a value the user set wins."""
    import os
    from pathlib import Path

    from apcscore.engine.parallel.ranks import current_group, shutdown_ranks
    from apcscore.engine.parallel.spawn import loopback_interface

    lo = loopback_interface()
    if lo is None or not Path("/proc/self/environ").exists():
        pytest.skip("no loopback interface to name, or no /proc to read a rank's environment from")

    def worker_env() -> dict[str, str]:
        (proc,) = current_group().processes
        raw = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
        return dict(item.decode(errors="replace").partition("=")[::2] for item in raw if item)

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    shutdown_ranks()
    try:
        load_native_engine(str(tiny_model_dir("llama")), EngineConfig(**BASE, tensor_parallel_size=2))
        assert worker_env().get("GLOO_SOCKET_IFNAME") == lo and "GLOO_SOCKET_IFNAME" not in os.environ
        shutdown_ranks()
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", lo)  # the user's choice (here the same interface) is kept
        load_native_engine(str(tiny_model_dir("llama")), EngineConfig(**BASE, tensor_parallel_size=2))
        assert os.environ["GLOO_SOCKET_IFNAME"] == lo
    finally:
        shutdown_ranks()


def test_a_worker_that_fails_names_its_error_on_rank_0(tiny_model_dir) -> None:
    """Issue 42 item 9: a worker exception left rank 0 in the op's collective (on NCCL until the 30-minute
    watchdog; gloo notices the closed socket) with only the transport's error. The worker leaves its error in
    the group's store; rank 0 reports it, and on NCCL a watch aborts the collective (tested below without GPUs)."""
    from apcscore.engine.parallel.ranks import current_group
    from apcscore.models.tensor_parallel import RanksFailed

    engine = load_native_engine(str(tiny_model_dir("llama")), EngineConfig(**BASE, tensor_parallel_size=2))
    runner = engine.runner
    # the worker runs "logits" before any forward: it has no hidden states and fails before its gather
    with pytest.raises(RanksFailed) as failed:
        runner._run("logits", ([0],), lambda: runner.tp.gather(torch.zeros(3)))
    message = " ".join(str(failed.value).split())
    assert "(rank 1 failed: AttributeError: 'NoneType' object has no attribute 'device')" in message, message
    assert not current_group().in_sync  # the next engine starts fresh ranks


def test_the_failure_watch_aborts_once_when_a_worker_fails_or_ends() -> None:
    """The NCCL half of item 9 without GPUs: the watch calls abort once a worker left a failure note, or once a
    spawned worker ended, and never while all is well."""
    import time

    from apcscore.engine.parallel.faults import FailureWatch

    class Proc:
        def __init__(self) -> None:
            self.alive = True

        def is_alive(self) -> bool:
            return self.alive

    for cause in ("note", "ended"):
        proc, note, aborts = Proc(), {"text": None}, []
        watch = FailureWatch([proc], note=lambda: note["text"], abort=lambda: aborts.append(1), poll=0.01).start()
        time.sleep(0.1)
        assert aborts == [] and not watch.fired
        if cause == "note":
            note["text"] = "rank 1 failed: OutOfMemoryError: CUDA out of memory"
        else:
            proc.alive = False
        deadline = time.monotonic() + 5
        while not aborts and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        assert aborts == [1] and watch.fired, cause
        watch.stop()


@pytest.mark.slow
def test_degree_4_agrees_and_is_batch_invariant(tiny_model_dir) -> None:
    """Four ranks (each KV head on two of them; four partial sums, where the rank order of the sum matters):
    within 1e-5 of degree 1, and exact across a budget that chunks, another order and preemption."""
    from apcscore.engine.parallel.ranks import shutdown_ranks

    shutdown_ranks()  # one process drives one degree at a time
    path = str(tiny_model_dir("llama"))
    # decoding 8 tokens carries each past a block boundary, so the tight pool below must preempt
    requests = score_requests(make_prompts([13, 29, 60, 155], 49152, seed=13))
    from test_invariance import columns

    one = _scores(load_native_engine(path, EngineConfig(**BASE)), requests)
    four = _scores(load_native_engine(path, EngineConfig(**BASE, tensor_parallel_size=4)), requests)
    worst = max(float(np.abs(one[r].prompt_logprobs.token_logprobs - four[r].prompt_logprobs.token_logprobs)
                      .max(initial=0)) for r in one)
    print(f"degree 4 vs 1 max |d logprob| {worst:.2e}")
    assert 0 < worst <= 1e-5
    # the matrix, lighter (four ranks share two cores): reversed order in a tight pool that preempts, at a budget
    # of 64 (the longer prompts in chunks)
    want = {r: columns(o) for r, o in four.items()}
    held = [Request(r.request_id, r.prompt_token_ids, prompt_logprobs=r.prompt_logprobs,
                    sampling=SamplingParams(max_tokens=8, ignore_eos=True)) for r in requests[::-1]]
    tight = load_native_engine(path, EngineConfig(**{**BASE, "num_kv_blocks": 13, "max_batch_tokens": 64},
                                                  tensor_parallel_size=4))
    assert_same({o.request_id: columns(o) for o in tight.run(held)}, want, "reversed order, preemption")
    assert tight.stats.preemptions > 0
