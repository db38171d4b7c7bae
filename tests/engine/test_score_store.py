"""Exact reuse's score store (issue 13, item 3): requests that score every position read cached blocks too, take
those positions' results from the store, score the boundary row from the stored hidden state and prefill only the
rest. Every output column must be bitwise what a full recompute returns (`np.array_equal`, no tolerance), across
budgets, shuffled order, forced preemption and a tiny pool that evicts mid-run; a request asking for more than an
entry holds computes instead. Each test also checks that the store was really read (hits, fewer tokens
prefilled), or it would compare recompute with recompute."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest

from apcscore import Engine, EngineConfig, Request, SamplingParams
from apcscore.engine.loader import load_native_engine
from apcscore.engine.block_manager import BlockManager
from apcscore.engine.score_store import ScoreEntry, ScoreStore, _targets
from apcscore.engine.step import Sequence, TokenLogprobs
from tests.engine.test_block_manager import check_invariants
from tests.engine.test_exact_reuse import assert_tables_equal, cli_run, engine, model  # noqa: F401 (model: a fixture)
from tests.engine.test_invariance import assert_same, columns, run

K = 3


def shared_prefix_requests(seed: int = 7, n: int = 8, prefix_len: int = 150, k: int = K) -> list[Request]:
    """Prompts scored at every position: one shared `prefix_len`-token system prompt, then 3..40 own tokens; two
    of them repeat a prompt exactly, and one continuation record (scored from its own context's end) rides along."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 49152, prefix_len).tolist()
    prompts = [prefix + rng.integers(3, 49152, int(rng.integers(3, 40))).tolist() for _ in range(n)]
    prompts += [prompts[1], prompts[n // 2]]
    reqs = [Request(i, p, prompt_logprobs=k) for i, p in enumerate(prompts)]
    ctx = prefix + [11, 12, 13]
    reqs.append(Request("cont", ctx + [14, 15, 16], prompt_logprobs=k, score_from=len(ctx)))
    return reqs


def alone(model: str, reqs: list[Request], **overrides) -> dict:
    """Full recompute, each request alone in a fresh engine."""
    want: dict = {}
    for r in reqs:
        want.update(run(engine(model, **overrides), [r]))
    return want


@pytest.fixture(scope="module")
def reference(model: str) -> dict:
    return alone(model, shared_prefix_requests())


def fed(reqs: list[Request]) -> int:
    return sum(len(r.prompt_token_ids) for r in reqs)


def test_store_reuse_equals_recompute_and_prefills_less(model: str, reference: dict) -> None:
    reqs = shared_prefix_requests()
    eng = engine(model, exact_reuse=True)
    assert_same(run(eng, reqs), reference, "score store")
    pc = eng.block_manager.stats
    # 9 full blocks (144 tokens) of the prefix are computed once; the 10 followers take 143 positions each from
    # the store (targets 1..143) except the continuation, which scores nothing in them
    assert pc.score_store_hits >= 9 * 143, pc
    assert eng.stats.prompt_tokens <= fed(reqs) - 10 * 144, eng.stats
    assert len(eng.store.entries) > 0
    assert set(eng.store.entries) <= set(eng.block_manager.cached)


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_store_reuse_in_bf16(model: str, dtype: str) -> None:
    reqs = shared_prefix_requests(seed=2, n=4)
    eng = engine(model, exact_reuse=True, dtype=dtype)
    assert_same(run(eng, reqs), alone(model, reqs, dtype=dtype), dtype)
    assert eng.block_manager.stats.score_store_hits > 0


@pytest.mark.parametrize("budget", [7, 16, 57, 100, 257, 4096])
def test_store_reuse_across_budgets(model: str, reference: dict, budget: int) -> None:
    reqs = shared_prefix_requests()
    if budget < 16:  # a 7-token budget is ~25 steps per request: keep four of them
        reqs = [r for r in reqs if r.request_id in (0, 1, 8, "cont")]
    eng = engine(model, exact_reuse=True, max_batch_tokens=budget)
    assert_same(run(eng, reqs), {r.request_id: reference[r.request_id] for r in reqs}, f"budget {budget}")
    assert eng.block_manager.stats.score_store_hits > 0


def test_store_reuse_shuffled_warm_and_one_at_a_time(model: str, reference: dict) -> None:
    reqs = shared_prefix_requests()
    random.Random(4).shuffle(reqs)
    eng = engine(model, exact_reuse=True, max_num_seqs=3)
    assert_same(run(eng, reqs), reference, "shuffled")
    hits = eng.block_manager.stats.score_store_hits
    assert_same(run(eng, reqs[::-1]), reference, "warm cache, reversed")
    assert eng.block_manager.stats.score_store_hits > hits > 0
    single = engine(model, exact_reuse=True, max_num_seqs=1, max_batch_tokens=64)
    assert_same(run(single, reqs), reference, "one sequence at a time, chunked")
    assert single.block_manager.stats.score_store_hits > 0


def test_store_reuse_under_preemption_and_eviction(model: str, reference: dict) -> None:
    """A pool of 24 blocks: the requests also decode a few tokens so they hold blocks; the engine must preempt,
    and cached blocks (with their store entries) are evicted and recomputed mid-run."""
    reqs = [Request(r.request_id, r.prompt_token_ids, prompt_logprobs=r.prompt_logprobs, score_from=r.score_from,
                    sampling=SamplingParams(max_tokens=8, ignore_eos=True)) for r in shared_prefix_requests()]
    eng = engine(model, exact_reuse=True, num_kv_blocks=24, max_batch_tokens=256)
    evicted: list[bytes] = []
    discard = eng.block_manager.on_evict
    eng.block_manager.on_evict = lambda h: (evicted.append(h), discard(h))
    got = {}
    for o in eng.run(reqs):
        p = o.prompt_logprobs
        got[o.request_id] = (p.token_ids, p.token_logprobs, p.ranks, p.top_ids, p.top_logprobs, p.positions)
        assert set(eng.store.entries) <= set(eng.block_manager.cached)  # entries die with their block
    assert_same(got, reference, "preemption")
    assert eng.stats.preemptions > 0, "the tiny pool did not preempt: the scenario tests nothing"
    assert evicted and eng.block_manager.stats.score_store_hits > 0
    check_invariants(eng.block_manager)


def test_a_larger_k_or_ranks_than_stored_computes_and_stays_exact(model: str) -> None:
    """Entries written with K = 2 and without ranks serve a K = 1 request without ranks, but not a K = 3 request
    nor one that wants ranks: those compute their positions (and then store better entries)."""
    rng = np.random.default_rng(3)
    prefix = rng.integers(3, 49152, 64).tolist()

    def req(rid, k: int, ranks: bool) -> Request:
        return Request(rid, prefix + rng.integers(3, 49152, 9).tolist(), prompt_logprobs=k, prompt_logprob_ranks=ranks)

    first, small, bigger, ranked, after = req("w", 2, False), req("s", 1, False), req("b", 3, False), \
        req("r", 2, True), req("a", 3, True)
    eng = engine(model, exact_reuse=True)
    stats = eng.block_manager.stats
    got = run(eng, [first])
    assert stats.score_store_hits == 0 and len(eng.store.entries) == 4
    got.update(run(eng, [small]))
    assert stats.score_store_hits == 63  # targets 1..63 of the 4 prefix blocks
    for r in (bigger, ranked):
        before, prefilled = stats.score_store_hits, eng.stats.prompt_tokens
        got.update(run(eng, [r]))
        assert stats.score_store_hits == before, f"{r.request_id} was served entries that do not cover it"
        assert eng.stats.prompt_tokens - prefilled == len(r.prompt_token_ids)
    assert all(e.k == 3 and e.has_ranks for e in eng.store.entries.values())  # replaced by covering entries
    got.update(run(eng, [after]))
    assert stats.score_store_hits == 2 * 63
    assert_same(got, alone(model, [first, small, bigger, ranked, after]), "k and ranks")


def test_followers_wait_for_the_prefix_and_read_it_once(model: str) -> None:
    """All at once: the shared prefix's blocks are prefilled by one request; the others wait and read the store."""
    reqs = [r for r in shared_prefix_requests() if r.request_id != "cont"]
    eng = engine(model, exact_reuse=True)
    run(eng, reqs)
    # every request but the first prefills only what lies after the prefix's 9 full blocks; the two repeats wait
    # for their twins and read every full block but the last token's
    repeats = sum((len(r.prompt_token_ids) - 1) // 16 * 16 - 144 for r in reqs[-2:])
    assert eng.stats.prompt_tokens == fed(reqs) - (len(reqs) - 1) * 144 - repeats


@pytest.mark.slow
def test_the_triton_backend_reads_the_store_exactly(model: str) -> None:
    import torch

    from apcscore.kernels._checks import interpreting

    if not interpreting() and not torch.cuda.is_available():
        pytest.skip("the Triton backend needs CUDA or TRITON_INTERPRET=1")
    device = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
    rng = np.random.default_rng(9)
    prefix = rng.integers(3, 49152, 12).tolist()
    reqs = [Request(i, prefix + rng.integers(3, 49152, 3).tolist(), prompt_logprobs=2) for i in range(3)]

    def triton(**kw) -> Engine:
        return load_native_engine(model, EngineConfig(device=device, dtype="float32", num_kv_blocks=64, block_size=4,
                                                      max_batch_tokens=8, attention_backend="triton",
                                                      use_cuda_graphs=False, **kw))

    reused = triton(exact_reuse=True)
    assert_same(run(reused, reqs), run(triton(), reqs), "triton")
    assert reused.block_manager.stats.score_store_hits == 2 * 11


# ---- the store itself ---------------------------------------------------------------------------------------
def entry(k: int, ranks: bool, rows: int = 4) -> ScoreEntry:
    import torch

    return ScoreEntry(4, np.zeros(rows, np.float32), np.zeros(rows, np.int64), np.zeros((rows, k), np.int64),
                      np.zeros((rows, k), np.float32), torch.zeros(8), ranks)


def test_entries_are_replaced_only_by_better_ones_and_never_written_into() -> None:
    store = ScoreStore()
    store.put(b"a", entry(2, False))
    first = store.entries[b"a"]
    assert not first.top_ids.flags.writeable
    store.put(b"a", entry(1, False))  # covers less: kept out
    assert store.entries[b"a"] is first
    ranked = entry(1, True)
    store.put(b"a", ranked)  # ranks, but a smaller K: a new entry with both, the old one untouched
    merged = store.entries[b"a"]
    assert merged is not first and merged.has_ranks and merged.k == 2 and not first.has_ranks
    assert merged.top_ids is first.top_ids and merged.ranks is ranked.ranks
    store.put(b"a", entry(5, True))
    assert store.entries[b"a"].k == 5 and store.nbytes == store.entries[b"a"].nbytes
    store.discard(b"a")
    assert len(store.entries) == 0 and store.nbytes == 0


def test_eviction_of_a_cached_block_drops_its_entry() -> None:
    bm, store = BlockManager(2, 4), ScoreStore()
    bm.on_evict = store.discard
    seq = Sequence(Request(0, [1, 2, 3, 4, 5], prompt_logprobs=1), 0)
    assert bm.allocate(seq, 5)
    seq.num_computed_tokens = 5
    bm.cache_full_blocks(seq)
    store.put(seq.block_hashes[0], entry(1, True))
    bm.free(seq)
    assert len(store.entries) == 1  # a freed block stays cached, and its entry with it
    other = Sequence(Request(1, [9] * 8), 1)
    assert bm.allocate(other, 8)  # takes both blocks: the cached one is evicted
    assert len(store.entries) == 0 and not bm.cached


def test_targets_are_taken_only_when_every_one_was_scored() -> None:
    def part(p0: int, n: int) -> TokenLogprobs:
        pos = np.arange(p0, p0 + n)
        return TokenLogprobs(pos.copy(), pos.astype(np.float32), pos.copy(), pos[:, None].repeat(2, 1),
                             pos[:, None].astype(np.float32).repeat(2, 1), positions=pos)

    lps, ranks, top, _ = _targets([part(1, 5), part(6, 3), part(9, 20)], 4, 12)
    assert lps.tolist() == list(range(4, 12)) and top.shape == (8, 2)
    assert _targets([part(1, 5), part(7, 20)], 4, 12) is None  # target 6 missing
    assert _targets([part(6, 20)], 4, 12) is None


# ---- the command line ---------------------------------------------------------------------------------------
SYSTEM = ("You are a careful assistant. Answer briefly and precisely, cite nothing, and keep a friendly tone. "
          "The user asks about everyday things: weather, cooking, travel, numbers and small facts. ") * 2


@pytest.mark.parametrize("command,flags", [("score", ("--prompt-logprobs", "3")),
                                           ("perplexity", ("--window", "40", "--stride", "17",
                                                           "--prompt-logprobs", "2")),
                                           ("generate", ("--prompt-logprobs", "2", "--max-tokens", "2"))])
def test_cli_store_reuse_writes_the_recompute_file(model: str, tmp_path, write_jsonl, command: str,
                                                   flags: tuple) -> None:
    tails = ["What is the weather like?", "How do I boil an egg?", "Name a big city.", "Two plus two?"]
    field = {"score": "prompt", "generate": "prompt", "perplexity": "text"}[command]
    records = [{"id": f"r{i}", field: SYSTEM + tail} for i, tail in enumerate(tails)]
    if command == "perplexity":  # consecutive windows share no prefix: repeated texts do
        records += [{"id": f"again{i}", "text": r["text"]} for i, r in enumerate(records)]
    res, want, meta = cli_run(model, tmp_path, command, records, write_jsonl, *flags)
    assert res.exit_code == 0, res.output
    res, got, meta2 = cli_run(model, tmp_path, command, records, write_jsonl, *flags, "--exact-reuse",
                              "--max-batch-tokens", "100")
    assert res.exit_code == 0, res.output
    assert_tables_equal(got, want)
    pc = meta2["timings"]["prefix_cache"]
    assert pc["score_store_hits"] > 0 and pc["hit_tokens"] > 0
    assert meta2["timings"]["prompt_tokens"] < meta["timings"]["prompt_tokens"]
    assert "served from the score store" in re.sub(r"[\s│]+", " ", res.output)  # the summary table may wrap it
    if command == "generate":  # the one column that may differ: it says how much of each prompt was read
        assert sum(got.column("num_cached_tokens").to_pylist()) > 0


# ---- the store never serves rows past the prompt (issue 24, item 1) --------------------------------------
def _preempt_once(name: str, after_outputs: int, until_finished: str | None = None):
    """An on_step hook that preempts the running request `name` once (the scheduler's own preemption: blocks freed,
    prompt and output re-prefilled later) when it has generated `after_outputs` tokens and `until_finished`, if
    given, has left the engine."""
    done: list[bool] = []

    def hook(eng: Engine) -> None:
        sched = eng.scheduler
        seq = next((s for s in sched.running if s.request_id == name), None)
        others = {s.request_id for s in (*sched.running, *sched.waiting)}
        if done or seq is None or len(seq.output_token_ids) < after_outputs or until_finished in others:
            return
        sched.running.remove(seq)
        sched._preempt(seq)
        done.append(True)

    return hook, done


def test_a_preempted_generation_reads_no_store_rows_past_its_prompt(model: str) -> None:
    """generate --prompt-logprobs with exact reuse: request "a" is preempted after generating; request "b"'s prompt
    is a's prompt, a's completion and more (multi-turn data built from the model's own answers), so b stores
    entries for blocks past a's prompt. Re-admitted, a must read the store only inside its prompt (at most
    (prompt_len - 1) // block_size blocks), or its prompt logprobs gain rows for its generated tokens."""
    rng = np.random.default_rng(3)
    prompt = rng.integers(3, 49152, 37).tolist()  # 37 = 2 full blocks of 16 and 5 tokens into the third
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    a = Request("a", prompt, prompt_logprobs=K, sampling=greedy)
    (want,) = engine(model).run([a])  # recompute, alone
    assert len(want.output_token_ids) == 24
    b = Request("b", prompt + list(want.output_token_ids) + [5, 6, 7, 8], prompt_logprobs=K,
                sampling=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    eng = engine(model, exact_reuse=True)
    hook, preempted = _preempt_once("a", after_outputs=20, until_finished="b")
    got = {o.request_id: o for o in eng.run([a, b], on_step=hook)}
    assert preempted, "a was never preempted: the scenario tests nothing"
    assert eng.block_manager.stats.score_store_hits > 0  # the store was read
    out = got["a"]
    assert out.error is None, out.error
    assert out.output_token_ids == want.output_token_ids
    assert_same({"a": columns(out)}, {"a": columns(want)}, "re-admitted after preemption")
    assert out.prompt_logprobs.positions[-1] == len(prompt) - 1  # no row for a generated token


def test_a_store_read_ending_at_the_last_prompt_token_scores_its_alternatives(model: str) -> None:
    """The cap's boundary: a 33-token prompt may read 2 blocks (targets 1..31) from the store, so its last token
    (position 32) and its last-token alternatives are scored from the stored hidden state of row 31; each must be
    bitwise what a separate recompute returns."""
    rng = np.random.default_rng(4)
    prompt = rng.integers(3, 49152, 33).tolist()
    alts = (101, 202, 303)
    writer = Request("w", prompt + rng.integers(3, 49152, 20).tolist(), prompt_logprobs=K)
    reader = Request("r", prompt, prompt_logprobs=K, last_token_alternatives=alts)
    eng = engine(model, exact_reuse=True)
    list(eng.run([writer]))
    hits = eng.block_manager.stats.score_store_hits
    (out,) = eng.run([reader])
    assert eng.block_manager.stats.score_store_hits - hits == 31  # blocks 0 and 1 served, the boundary row scored
    assert_same({"r": columns(out)}, {"r": columns(next(iter(engine(model).run([reader]))))}, "boundary")
    for i, alt in enumerate(alts):
        (sep,) = engine(model).run([Request(("alt", i), prompt[:-1] + [alt], prompt_logprobs=K)])
        p, lt = sep.prompt_logprobs, out.last_token_alternatives
        for f in ("token_ids", "token_logprobs", "ranks", "top_ids", "top_logprobs"):
            assert np.array_equal(getattr(lt, f)[i], getattr(p, f)[-1]), (alt, f)
