"""`--shard I/N` and `apcscore merge` (issue 17): the shards of a prefix-aware split, merged, equal a single run
bitwise (every column; metadata but timings and provenance); merge refuses gaps, overlaps, other splits and
other configurations. Plus the partitioner's own properties (deterministic, prefix groups kept together,
balanced, heavy groups split)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from apcscore.cli import app
from apcscore.io.identity import NOT_BITS
from apcscore.scale.partition import Item, assign, block_digests

runner = CliRunner()
# fields that say when and how a file was made, not what it holds
PROVENANCE = {"timings", "created", "argv", "merged", "sessions", "resumed"}


def run(*args) -> object:
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


def shared_prefix_records(groups: int = 5, per_group: int = 4, seed: int = 3) -> list[dict]:
    """Token-id prompts in `groups` groups sharing a 40-token prefix (2 full blocks of 16), shuffled."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prefix = [rng.randrange(3, 49152) for _ in range(40)]
        for k in range(per_group):
            out.append({"id": f"g{g}-{k}", "prompt_token_ids": prefix + [rng.randrange(3, 49152)
                                                                          for _ in range(rng.randrange(1, 12))]})
    rng.shuffle(out)
    return out


def score_records() -> list[dict]:
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    text = [{"id": f"p{i}", "prompt": " ".join(words[j % 10] for j in range(i % 23 + 2))} for i in range(12)]
    ll = [{"id": "c1", "context": "The sky is", "continuation": " blue"},
          {"id": "m1", "context": "Two plus two is", "choices": [" four", " five"], "answer": 0}]
    return shared_prefix_records() + text + ll + [{"id": "bad", "prompt_token_ids": []}]


def meta(path) -> dict:
    return json.loads(pq.read_schema(path).metadata[b"apcscore"])


def assert_same_file(merged, single) -> None:
    a, b = pq.read_table(merged), pq.read_table(single)
    assert a.schema.remove_metadata().equals(b.schema.remove_metadata())
    for name in b.column_names:  # every column, bitwise (nulls in place)
        assert a.column(name).equals(b.column(name)), name
    ma, mb = meta(merged), meta(single)
    for m in (ma, mb):  # engine and numerics as merge compares them (pool size, probe timing: not bits)
        for key in ("engine", "numerics"):
            m[key] = {k: v for k, v in m[key].items() if f"{key}.{k}" not in NOT_BITS}
    assert {k: v for k, v in ma.items() if k not in PROVENANCE} == {k: v for k, v in mb.items() if k not in PROVENANCE}


def shards_and_merge(tmp_path, command, data, common, n, name="s") -> tuple[list, object]:
    parts = []
    for i in range(n):
        part = tmp_path / f"{name}{i}.parquet"
        res = run(command, data, *common, "--shard", f"{i}/{n}", "--out", part)
        assert res.exit_code == 0, res.output
        parts.append(part)
    merged = tmp_path / f"{name}-merged.parquet"
    res = run("merge", merged, *reversed(parts))  # any order
    assert res.exit_code == 0, res.output
    return parts, merged


@pytest.mark.parametrize("command", ["score", "generate"])
def test_shards_plus_merge_equal_a_single_run(tmp_path, write_jsonl, tiny, command) -> None:
    records = score_records() if command == "score" else [
        {k: v for k, v in r.items()} for r in shared_prefix_records()] + [{"id": "t", "prompt": "Hello", "seed": 7}]
    data = write_jsonl(tmp_path / "d.jsonl", records)
    common = ["--model", tiny, "--num-kv-blocks", 256, "--skip-invalid", "-q"]
    common += ["--prompt-logprobs", 2] if command == "score" else ["--temperature", 0.9, "--max-tokens", 5,
                                                                   "--logprobs", 1]
    single = tmp_path / "single.parquet"
    res = run(command, data, *common, "--out", single)
    assert res.exit_code == 0, res.output
    parts, merged = shards_and_merge(tmp_path, command, data, common, 3)
    sizes = [meta(p)["shard"]["num_rows"] for p in parts]
    assert sum(sizes) == len(records) and all(sizes)
    # the prefix groups were kept together: each group's rows are in one shard
    where = {}
    for i, p in enumerate(parts):
        for rid in pq.read_table(p, columns=["id"]).column("id").to_pylist():
            where.setdefault(rid.split("-")[0], set()).add(i)
    assert all(len(where[f"g{g}"]) == 1 for g in range(5))
    assert_same_file(merged, single)
    m = meta(merged)
    assert len(m["merged"]["shards"]) == 3 and "shard" not in m
    assert m["timings"]["prompt_tokens"] == sum(meta(p)["timings"]["prompt_tokens"] for p in parts)


def test_perplexity_shards_plus_merge_equal_a_single_run(tmp_path, write_jsonl, tiny) -> None:
    body = "the quick brown fox jumps over the lazy dog " * 12
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": f"t{i}", "text": body[: 40 + 37 * i]} for i in range(7)])
    common = ["--model", tiny, "--num-kv-blocks", 256, "--window", 64, "--stride", 32, "-q"]
    single = tmp_path / "single.parquet"
    assert run("perplexity", data, *common, "--out", single).exit_code == 0
    _, merged = shards_and_merge(tmp_path, "perplexity", data, common, 2)
    assert_same_file(merged, single)


def test_merge_refuses_gaps_overlaps_other_splits_and_configurations(tmp_path, write_jsonl, tiny) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", shared_prefix_records(groups=3, per_group=2))
    common = ["score", data, "--model", tiny, "--num-kv-blocks", 128, "-q"]
    files = {}
    for key, extra in {"0/3": [], "1/3": [], "2/3": [], "0/2": [], "k1": ["--prompt-logprobs", 1]}.items():
        shard = key if "/" in key else "1/3"
        files[key] = tmp_path / f"{key.replace('/', 'of')}.parquet"
        res = run(*common, *extra, "--shard", shard, "--out", files[key])
        assert res.exit_code == 0, res.output
    plain = tmp_path / "plain.parquet"
    assert run(*common, "--out", plain).exit_code == 0

    def refused(*parts) -> str:
        out = tmp_path / "m.parquet"
        res = run("merge", out, *parts)
        assert res.exit_code == 2 and not out.exists(), res.output
        assert "Traceback" not in res.output
        return " ".join(res.output.split())

    assert "gap: shard 2/3 of 3 is missing" in refused(files["0/3"], files["1/3"])
    assert "overlap" in refused(files["0/3"], files["1/3"], files["1/3"], files["2/3"])
    assert "split the dataset differently" in refused(files["0/3"], files["1/3"], files["2/3"], files["0/2"])
    assert "not shards of one dataset under one configuration" in refused(files["0/3"], files["k1"], files["2/3"])
    assert "not a shard file" in refused(files["0/3"], plain)
    assert "no such shard file" in refused(files["0/3"], tmp_path / "nope.parquet")
    res = run("merge", tmp_path / "ok.parquet", files["2/3"], files["0/3"], files["1/3"])
    assert res.exit_code == 0, res.output
    assert pq.read_table(tmp_path / "ok.parquet").equals(pq.read_table(plain))


def test_merge_checks_out_as_score_checks_its_out(tmp_path) -> None:
    """Issue 46, item 6: a folder OUT with --overwrite raised IsADirectoryError, /proc/out.parquet
    FileNotFoundError and a path under a file FileExistsError; each is now one line, exit 2, before any shard
    is read."""
    shard = tmp_path / "s0.parquet"
    shard.write_text("not read")
    (tmp_path / "dir").mkdir()
    cases = {(tmp_path / "dir", "--overwrite"): f"OUT {tmp_path / 'dir'} is a directory — give a file name such as",
             (tmp_path / "s0.parquet" / "m.parquet",): f"{tmp_path / 's0.parquet'} is a file, not a folder — choose "
                                                       "another OUT",
             ("/proc/out.parquet",): "OUT /proc/out.parquet: cannot write in /proc",
             # item 12 for merge: a parquet file under a data format's name (read back, it would not decode)
             (tmp_path / "m.csv",): f"OUT {tmp_path / 'm.csv'}: the merged file is written as parquet, and a .csv "
                                    "name says CSV",
             (tmp_path / "m.jsonl.gz",): "a .gz name says gzip-compressed data (read back as a dataset, the file "
                                         "would not decode) — name it m.jsonl.parquet"}
    for (out, *extra), message in cases.items():
        res = run("merge", out, shard, *extra)
        text = " ".join(res.output.split())
        assert res.exit_code == 2 and message in text and "Traceback" not in text, res.output
        assert not Path(out).is_file()


def test_merge_names_what_it_was_given_wrongly(tmp_path) -> None:
    """Issue 46, item 13: an eval shard folder beside a score file was "no such shard file"; a finished eval run
    without --shard was called unfinished."""
    folder, done, shard = tmp_path / "ev0", tmp_path / "ev", tmp_path / "s0.parquet"
    folder.mkdir()
    done.mkdir()
    shard.write_text("not read")
    (done / "eval_run.json").write_text("{}")
    (done / "results.json").write_text("{}")
    res = run("merge", tmp_path / "m.parquet", folder, shard)
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and f"{folder} is a folder (an eval shard?) and {shard} is not" in text, res.output
    res = run("merge", tmp_path / "m", done)
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and "a finished eval run without --shard: there is nothing to merge" in text, \
        res.output
    assert "unfinished" not in text


def test_bad_shard_options_are_refused(tmp_path, write_jsonl, tiny) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi"}])
    for value, text in (("3/3", "0 <= I < N"), ("1-3", "must be I/N"), ("0/0", "N >= 1")):
        res = run("score", data, "--model", tiny, "--shard", value)
        assert res.exit_code == 2 and text in res.output, res.output
    res = run("score", data, "--model", tiny, "--replicas", 2)
    assert res.exit_code == 2 and "--ray" in res.output
    res = run("score", data, "--model", tiny, "--ray", "local", "--shard", "0/2")
    assert res.exit_code == 2 and "contradict" in res.output


def test_shards_without_out_write_files_of_their_own(tmp_path, write_jsonl, tiny, monkeypatch) -> None:
    """The default output names the shard: shard 1 does not find shard 0's file taken (or replace it), and
    the two merge into the single run's file."""
    data = write_jsonl(tmp_path / "d.jsonl", score_records()[:-1])
    monkeypatch.chdir(tmp_path)
    common = ["--model", tiny, "--num-kv-blocks", 256, "--quiet"]  # a fixed pool: auto-sizing reads free memory
    for i in range(2):
        res = run("score", data, *common, "--shard", f"{i}/2")
        assert res.exit_code == 0, res.output
    parts = sorted((tmp_path / "results").glob("*.parquet"))
    assert [p.name for p in parts] == ["d.score.shard-0-of-2.parquet", "d.score.shard-1-of-2.parquet"]
    assert run("score", data, *common, "--out", tmp_path / "single.parquet").exit_code == 0
    assert run("merge", tmp_path / "merged.parquet", *parts).exit_code == 0
    assert_same_file(tmp_path / "merged.parquet", tmp_path / "single.parquet")


# ---- the partitioner ---------------------------------------------------------------------------------------
def items_of(prompts: list[list[int]], block_size: int = 4) -> list[Item]:
    return [Item(i, block_digests(p, block_size), len(p)) for i, p in enumerate(prompts)]


def test_partition_keeps_prefix_groups_together_and_balances() -> None:
    rng = random.Random(0)
    prompts, group = [], []
    for g in range(12):
        prefix = [rng.randrange(1000) for _ in range(8)]
        for _ in range(rng.randrange(2, 7)):
            prompts.append(prefix + [rng.randrange(1000) for _ in range(rng.randrange(0, 9))])
            group.append(g)
    order = list(range(len(prompts)))
    rng.shuffle(order)
    prompts, group = [prompts[i] for i in order], [group[i] for i in order]
    items = items_of(prompts)
    parts = assign(items, 3)
    assert parts == assign(items_of(prompts), 3)  # deterministic
    for g in range(12):
        assert len({p for p, gg in zip(parts, group) if gg == g}) == 1
    loads = [sum(it.load for it, p in zip(items, parts) if p == k) for k in range(3)]
    assert max(loads) - min(loads) <= max(sum(it.load for it, gg in zip(items, group) if gg == g) for g in range(12))
    rand = assign(items, 3, "random")
    assert any(len({p for p, gg in zip(rand, group) if gg == g}) > 1 for g in range(12))  # the test can fail


def test_a_group_too_heavy_for_one_part_is_split_by_its_next_block() -> None:
    # every prompt shares the first block; 4 sub-groups share the second
    prompts = [[1, 2, 3, 4] + [10 * s + 1, 10 * s + 2, 10 * s + 3, 10 * s + 4] + [k]
               for s in range(4) for k in range(5)]
    parts = assign(items_of(prompts), 2)
    assert sorted(parts.count(p) for p in (0, 1)) == [10, 10]
    for s in range(4):
        assert len(set(parts[5 * s:5 * s + 5])) == 1  # the second-block groups stay whole
    same = [[1, 2, 3, 4, 5, 6, 7, 8]] * 6  # identical prompts: cut into runs, still balanced
    assert sorted(assign(items_of(same), 2)) == [0, 0, 0, 1, 1, 1]


@pytest.mark.slow
def test_partitioning_a_million_records_behind_one_long_prefix_takes_seconds() -> None:
    """Every record shares its first MAX_DEPTH blocks (a long system prompt): the group is cut into runs. Summing
    a run again for each item made this quadratic (4k records 0.09 s, 100k about a minute, 1M over an hour)."""
    import time

    from apcscore.scale.partition import MAX_DEPTH

    shared = block_digests(list(range(MAX_DEPTH * 4)), 4)
    n, parts = 1_000_000, 4
    items = [Item(i, shared, 100 + i % 7) for i in range(n)]
    start = time.perf_counter()
    assigned = assign(items, parts)
    elapsed = time.perf_counter() - start
    assert elapsed < 8.0, f"partitioning {n} records took {elapsed:.1f} s"
    counts = [assigned.count(p) for p in range(parts)]
    assert max(counts) - min(counts) <= 2  # balanced


def test_ray_without_the_extra_is_a_clear_error(monkeypatch) -> None:
    import sys

    from apcscore.errors import ApcscoreError
    from apcscore.run.ray_replicas import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(ApcscoreError, match=r"pip install 'apcscore\[ray\]'"):
        import_ray()
