"""The engine against Hugging Face transformers on tiny random-weight models, and its invariances.

Tolerances (fp32 on CPU): logits within 1e-4 of transformers; prompt logprobs within 1e-4; ranks and top-K
equal up to near-ties within 1e-5; greedy tokens equal. Scores are bitwise identical across prefix caching
on/off, chunk sizes and preemption.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from apcscore import EngineConfig, Request, SamplingParams
from apcscore.engine import Engine
from apcscore.engine.loader import load_native_engine
from tests.engine.test_block_manager import check_invariants

ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3", "neox", "olmo2", "phi3", "phi3_longrope", "phi3_partial",
         "mixtral", "qwen2_moe", "gemma2", "gemma3"]


def make_engine(model_dir, **overrides) -> Engine:
    cfg = dict(device="cpu", dtype="float32", num_kv_blocks=256, block_size=4, max_batch_tokens=64)
    cfg.update(overrides)
    return load_native_engine(str(model_dir), EngineConfig(**cfg))


def prompts(n_list, seed=0, vocab=49152):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in n_list]


def score_all(engine: Engine, ps, k=3):
    outs = {o.request_id: o for o in engine.run(Request(i, p, prompt_logprobs=k) for i, p in enumerate(ps))}
    assert all(o.error is None for o in outs.values())
    return [outs[i] for i in range(len(ps))]


def assert_ranks_match(ranks, ref_logprobs, ref_target, tol):
    """Ranks equal the reference's, up to entries within `tol` of the target (float near-ties in the tail)."""
    lo = (ref_logprobs > ref_target[:, None] + tol).sum(-1) + 1
    hi = (ref_logprobs > ref_target[:, None] - tol).sum(-1) + 1
    ranks = torch.as_tensor(ranks)
    assert bool(((ranks >= lo) & (ranks <= hi)).all())


@pytest.fixture(scope="module", params=ARCHS)
def arch_pair(request, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir(request.param)
    # eager attention, the reference: SDPA drops Gemma 2's attention soft-cap in transformers 5.17
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return request.param, path, hf


@pytest.mark.slow
def test_logits_match_transformers(arch_pair):
    arch, path, hf = arch_pair
    engine = make_engine(path)
    ids = prompts([37])[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]  # [T, V]
    # full prompt logprobs with K = vocab-wide check through logits: compare the model directly
    from apcscore.attention.metadata import set_attention_metadata
    from apcscore.engine.step import Sequence

    seq = Sequence(Request(0, ids), 0, engine.long_rope_after)  # (long-rope Phi-3: 37 > 32, the long tables)
    assert engine.block_manager.allocate(seq, len(ids))
    input_ids, positions, meta = engine.runner._stage(engine.runner._step_inputs([(seq, len(ids))]))
    with torch.no_grad(), set_attention_metadata(meta):
        ours = engine.model.compute_logits(engine.model(input_ids, positions))[:len(ids)]
    assert (ours - ref).abs().max().item() < 1e-4, arch


@pytest.mark.slow
def test_prompt_logprobs_ranks_topk_match_transformers(arch_pair):
    arch, path, hf = arch_pair
    engine = make_engine(path, max_batch_tokens=32)  # forces chunked prefill of the longer prompts
    ps = prompts([2, 9, 50, 77], seed=1)
    outs = score_all(engine, ps, k=5)
    for p, out in zip(ps, outs):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1)[:-1]  # predicts tokens 1..
        target = torch.tensor(p[1:])
        ref_lp = ref.gather(1, target[:, None])[:, 0]
        lps = out.prompt_logprobs
        assert lps.positions.tolist() == list(range(1, len(p)))
        assert np.abs(lps.token_logprobs - ref_lp.numpy()).max() < 1e-4
        assert_ranks_match(lps.ranks, ref, ref_lp, tol=1e-5)
        ref_top = ref.topk(5, -1)
        assert np.abs(lps.top_logprobs - ref_top.values.numpy()).max() < 1e-4
        # the same ids, or an id whose reference logprob ties within 1e-5 (random weights give near-ties)
        at_ours = ref.gather(1, torch.from_numpy(lps.top_ids)).numpy()
        same = lps.top_ids == ref_top.indices.numpy()
        assert np.all(same | (np.abs(at_ours - ref_top.values.numpy()) < 1e-5))
        assert same.mean() > 0.95


@pytest.mark.slow
def test_greedy_generation_equals_generate(arch_pair):
    arch, path, hf = arch_pair
    engine = make_engine(path)
    ps = prompts([5, 18, 33], seed=2)
    outs = {o.request_id: o for o in engine.run(
        Request(i, p, sampling=SamplingParams(max_tokens=12, ignore_eos=True)) for i, p in enumerate(ps))}
    for i, p in enumerate(ps):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(p):].tolist()
        assert outs[i].output_token_ids == ref, arch
        assert outs[i].finish_reason == "length"


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir):
    return tiny_model_dir("llama")


def test_scoring_is_bitwise_identical_with_prefix_caching_on_and_off(llama_dir):
    shared = prompts([40], seed=3)[0]
    ps = [shared + p for p in prompts([3, 11, 20], seed=4)] + [shared]
    # warm the cache with generation requests first, so a cached prefix is there to (not) read
    on = make_engine(llama_dir)
    list(on.run(Request(f"g{i}", p, sampling=SamplingParams(max_tokens=3)) for i, p in enumerate(ps)))
    off = make_engine(llama_dir, enable_prefix_caching=False)
    list(off.run(Request(f"g{i}", p, sampling=SamplingParams(max_tokens=3)) for i, p in enumerate(ps)))
    a, b = score_all(on, ps), score_all(off, ps)
    for x, y in zip(a, b):
        assert x.num_cached_tokens == 0 and y.num_cached_tokens == 0  # scoring never reads the cache
        for field in ("token_logprobs", "ranks", "top_ids", "top_logprobs"):
            assert np.array_equal(getattr(x.prompt_logprobs, field), getattr(y.prompt_logprobs, field))


def test_generation_reads_the_prefix_cache_scoring_does_not(llama_dir):
    engine = make_engine(llama_dir)
    shared = prompts([48], seed=5)[0]
    ps = [shared + p for p in prompts([5, 7, 9, 6], seed=6)]
    gen = list(engine.run(Request(i, p, sampling=SamplingParams(max_tokens=4)) for i, p in enumerate(ps)))
    cached = sorted(o.num_cached_tokens for o in gen)
    assert cached[0] == 0 and all(c == 48 for c in cached[1:])  # the first computes, the rest hit
    scored = score_all(engine, ps)
    assert all(o.num_cached_tokens == 0 for o in scored)
    assert engine.block_manager.stats.hit_tokens == 3 * 48


def test_generation_hits_blocks_written_by_scoring(llama_dir):
    engine = make_engine(llama_dir)
    p = prompts([30], seed=7)[0]
    score_all(engine, [p])
    (out,) = engine.run([Request(0, p + [5, 6], sampling=SamplingParams(max_tokens=2))])
    assert out.num_cached_tokens == 28  # 7 full blocks of 4 written by the scoring request


@pytest.mark.slow
def test_tiny_batch_budget_and_preemption_do_not_change_scores(llama_dir):
    ps = prompts([13, 29, 64, 8, 41], seed=8)
    ref = score_all(make_engine(llama_dir, max_batch_tokens=512), ps)
    tiny = score_all(make_engine(llama_dir, max_batch_tokens=8), ps)  # every prompt chunked into 8-token pieces
    # generation with prompt logprobs holds blocks while decoding: a small pool forces preemption, and the
    # preempted requests recompute their prompt logprobs
    small = make_engine(llama_dir, num_kv_blocks=24, max_batch_tokens=32)
    outs = {o.request_id: o for o in small.run(
        Request(i, p, prompt_logprobs=3, sampling=SamplingParams(max_tokens=12, ignore_eos=True))
        for i, p in enumerate(ps))}
    assert small.stats.preemptions > 0
    for got in (tiny, [outs[i] for i in range(len(ps))]):
        for x, y in zip(ref, got):
            for field in ("token_logprobs", "ranks", "top_ids", "top_logprobs"):  # bitwise
                assert np.array_equal(getattr(x.prompt_logprobs, field), getattr(y.prompt_logprobs, field))


@pytest.mark.slow
def test_preemption_during_generation_gives_the_same_tokens(llama_dir):
    ps = prompts([20, 25, 30, 22], seed=9)

    def req() -> list[Request]:
        return [Request(i, p, sampling=SamplingParams(max_tokens=16, ignore_eos=True)) for i, p in enumerate(ps)]

    big = {o.request_id: o.output_token_ids for o in make_engine(llama_dir).run(req())}
    small = make_engine(llama_dir, num_kv_blocks=16)
    got = {o.request_id: o.output_token_ids for o in small.run(req())}
    assert got == big
    assert small.stats.preemptions > 0


@pytest.mark.slow
def test_seeded_sampling_is_reproducible_whatever_the_batch(llama_dir):
    p = prompts([10], seed=10)[0]
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = list(make_engine(llama_dir).run([Request(0, p, sampling=params)]))[0].output_token_ids
    others = [Request(i, q, sampling=SamplingParams(max_tokens=12, temperature=1.0, seed=i, ignore_eos=True))
              for i, q in enumerate(prompts([7, 15, 9], seed=11), start=1)]
    batch = {o.request_id: o.output_token_ids
             for o in make_engine(llama_dir).run([*others, Request(0, p, sampling=params)])}
    assert batch[0] == alone
    other_seed = list(make_engine(llama_dir).run([Request(0, p, sampling=SamplingParams(
        max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=99, ignore_eos=True))]))[0].output_token_ids
    assert other_seed != alone


def test_top_k_one_is_greedy(llama_dir):
    p = prompts([10], seed=12)[0]
    greedy = list(make_engine(llama_dir).run([Request(0, p, sampling=SamplingParams(max_tokens=8, ignore_eos=True))]))
    top1 = list(make_engine(llama_dir).run([Request(0, p, sampling=SamplingParams(
        max_tokens=8, temperature=0.7, top_k=1, seed=3, ignore_eos=True))]))
    assert greedy[0].output_token_ids == top1[0].output_token_ids


def test_stop_token_ids_eos_and_stop_strings(llama_dir, default_tokenizer):
    engine = make_engine(llama_dir)
    p = prompts([10], seed=13)[0]
    (free,) = engine.run([Request(0, p, sampling=SamplingParams(max_tokens=10, ignore_eos=True))])
    first, third = free.output_token_ids[0], free.output_token_ids[2]
    (by_id,) = engine.run([Request(0, p, sampling=SamplingParams(max_tokens=10, stop_token_ids=(third,),
                                                                 ignore_eos=True))])
    assert by_id.finish_reason == "stop" and by_id.output_token_ids == free.output_token_ids[:3]
    engine.eos_token_ids = {first}
    (eos,) = engine.run([Request(0, p, sampling=SamplingParams(max_tokens=10))])
    assert eos.finish_reason == "stop" and eos.output_token_ids == [first]
    engine.eos_token_ids = set()
    text = free.output_text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    if stop.strip():
        (by_str,) = engine.run([Request(0, p, sampling=SamplingParams(max_tokens=10, stop=(stop,)))])
        assert by_str.finish_reason == "stop" and stop not in by_str.output_text
        assert text.startswith(by_str.output_text)


def test_sampled_token_logprobs(llama_dir):
    engine = make_engine(llama_dir)
    p = prompts([12], seed=14)[0]
    (out,) = engine.run([Request(0, p, sampling=SamplingParams(max_tokens=5, logprobs=3, ignore_eos=True))])
    lps = out.output_logprobs
    assert lps.token_ids.tolist() == out.output_token_ids
    assert lps.ranks.tolist() == [1] * 5  # greedy picks the argmax
    assert np.allclose(lps.top_logprobs[:, 0], lps.token_logprobs)
    assert lps.top_ids.shape == (5, 3)


def test_bad_requests_become_errors_not_crashes(llama_dir):
    engine = make_engine(llama_dir, num_kv_blocks=8)  # 32 tokens of KV
    outs = {o.request_id: o for o in engine.run([
        Request("empty", []),
        Request("too-long", list(range(3000)), prompt_logprobs=0),
        Request("pool", list(range(40)), prompt_logprobs=0),
        Request("vocab", [10 ** 9], prompt_logprobs=0),
        Request("ok", list(range(1, 10)), prompt_logprobs=0),
    ])}
    assert "no tokens" in outs["empty"].error
    assert "context" in outs["too-long"].error
    assert "KV blocks" in outs["pool"].error
    assert "vocabulary" in outs["vocab"].error
    assert outs["ok"].error is None and len(outs["ok"].prompt_logprobs) == 8


def test_every_step_respects_the_token_budget_and_sequence_cap(llama_dir):
    engine = make_engine(llama_dir, max_batch_tokens=24, max_num_seqs=3)
    steps = []
    schedule = engine.scheduler.schedule

    def spy():
        batch = schedule()
        steps.append((sum(n for _, n in batch), len(batch), len(engine.scheduler.running)))
        return batch

    engine.scheduler.schedule = spy
    ps = prompts([50, 3, 17, 9, 30, 5], seed=15)
    outs = list(engine.run(Request(i, p, prompt_logprobs=0, sampling=SamplingParams(max_tokens=4, ignore_eos=True))
                           for i, p in enumerate(ps)))
    assert len(outs) == 6 and all(o.error is None for o in outs)
    assert all(tokens <= 24 and seqs <= 3 and running <= 3 for tokens, seqs, running in steps)
    assert max(t for t, _, _ in steps) == 24  # the budget is used, prompts are chunked to fill it
    # deterministic: the same inputs and config give the same schedule
    again = make_engine(llama_dir, max_batch_tokens=24, max_num_seqs=3)
    steps2 = []
    schedule2 = again.scheduler.schedule
    again.scheduler.schedule = lambda: (lambda b: (steps2.append((sum(n for _, n in b), len(b),
                                                                   len(again.scheduler.running))), b)[1])(schedule2())
    list(again.run(Request(i, p, prompt_logprobs=0, sampling=SamplingParams(max_tokens=4, ignore_eos=True))
                   for i, p in enumerate(ps)))
    assert steps2 == steps


def test_decode_with_a_shared_cached_prefix_equals_decode_alone(llama_dir):
    """Decode reads shared prefix tiles once for the whole batch; the bits must not change."""
    shared = prompts([300], seed=16)[0]  # several key tiles, all sequences hit the same blocks
    ps = [shared + p for p in prompts([3, 9, 5, 12], seed=17)]
    params = SamplingParams(max_tokens=6, logprobs=3, ignore_eos=True)
    engine = make_engine(llama_dir, num_kv_blocks=512)
    list(engine.run([Request("warm", shared + [1], sampling=SamplingParams(max_tokens=1))]))
    together = {o.request_id: o for o in engine.run(Request(i, p, sampling=params) for i, p in enumerate(ps))}
    assert all(o.num_cached_tokens >= 296 for o in together.values())
    for i, p in enumerate(ps):
        (alone,) = make_engine(llama_dir, num_kv_blocks=512).run([Request(i, p, sampling=params)])
        assert alone.output_token_ids == together[i].output_token_ids
        for field in ("token_logprobs", "ranks", "top_ids", "top_logprobs"):
            assert np.array_equal(getattr(alone.output_logprobs, field), getattr(together[i].output_logprobs, field))


def test_reused_logprob_buffers_give_the_same_bits():
    """The CPU logprob path reuses [rows, vocab] buffers (kernels/buffers.py); results must not change,
    and a chunk's results must not alias the buffers the next chunk overwrites."""
    from functools import partial

    from apcscore.engine.logprobs import chunked_token_logprobs
    from apcscore.kernels.buffers import reused_buffer
    from apcscore.kernels.logprobs_torch import token_logprobs_torch

    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(300, 32, generator=g), torch.randn(1000, 32, generator=g)
    targets = torch.randint(0, 1000, (300,), generator=g)

    def logits(h, buffer=None):
        out = None if buffer is None else reused_buffer(buffer, (h.shape[0], 1000), torch.float32)
        return torch.nn.functional.linear(h, weight) if out is None else torch.mm(h, weight.t(), out=out)

    plain = chunked_token_logprobs(logits, hidden, targets, 5, 64)
    reused = chunked_token_logprobs(partial(logits, buffer="logits"), hidden, targets, 5, 64,
                                    partial(token_logprobs_torch, reuse_buffers=True))
    for field in ("token_logprobs", "ranks", "top_ids", "top_logprobs"):
        assert np.array_equal(getattr(plain, field), getattr(reused, field)), field


# ---- an abandoned run (issue 53 item 3): the next run yields only its own outputs


def _mixed(tag: str, ps: list[list[int]]) -> list[Request]:
    """Scoring, generation and both at once, so a run holds running and waiting sequences of every kind."""
    kinds = [dict(prompt_logprobs=3), dict(sampling=SamplingParams(max_tokens=5, ignore_eos=True)),
             dict(prompt_logprobs=2, sampling=SamplingParams(max_tokens=3, logprobs=2, ignore_eos=True))]
    return [Request((tag, i), p, **kinds[i % 3]) for i, p in enumerate(ps)]


def _results(outs) -> dict:
    """Each output's results (not num_cached_tokens: the abandoned run leaves cached blocks behind), by request id."""
    def arrays(lps):
        return None if lps is None else [getattr(lps, f).tolist() for f in ("token_ids", "token_logprobs", "ranks",
                                                                            "top_ids", "top_logprobs")]
    return {o.request_id: (o.error, o.output_token_ids, o.finish_reason, arrays(o.prompt_logprobs),
                           arrays(o.output_logprobs)) for o in outs}


@pytest.mark.parametrize("how, exact_reuse", [("break", False), ("raise", False), ("on_step", False),
                                               ("left open", False), ("raise", True)])
def test_an_abandoned_run_leaves_nothing_for_the_next(llama_dir, how, exact_reuse):
    """The consumer leaves a run after its first output: every sequence it left is freed (the pool is empty), and
    the next run yields exactly its own requests' outputs, bitwise those of a fresh engine (with exact reuse too:
    the abandoned run's cached blocks and score-store entries are there to read)."""
    shared = prompts([16], seed=41)[0]  # a prefix the abandoned run caches and the next one reads
    old = _mixed("old", [shared + p for p in prompts([9, 14, 5, 11, 7, 20, 6, 13], seed=42)])
    new = _mixed("new", [shared + p for p in prompts([4, 12, 8, 10, 15], seed=43)])
    engine = make_engine(llama_dir, max_batch_tokens=32, max_num_seqs=3, exact_reuse=exact_reuse)

    class Stop(Exception):
        pass

    seen = []
    if how == "break":
        for out in engine.run(old):
            seen.append(out)
            break
    elif how == "raise":
        with pytest.raises(Stop):
            for out in engine.run(old):
                seen.append(out)
                raise Stop
    elif how == "on_step":
        def boom(_engine):
            raise Stop
        with pytest.raises(Stop):
            for out in engine.run(old, on_step=boom):
                seen.append(out)
    else:  # the generator is neither exhausted nor closed when the next run starts
        left = engine.run(old)
        seen.append(next(left))
    assert len(seen) == 1 and seen[0].request_id[0] == "old"
    if how != "left open":
        assert not engine.scheduler.has_work and engine.block_manager.num_used_blocks == 0
        check_invariants(engine.block_manager)

    got = list(engine.run(new))
    assert not engine.scheduler.has_work and engine.block_manager.num_used_blocks == 0
    assert sorted(o.request_id for o in got) == [r.request_id for r in new]
    fresh = make_engine(llama_dir, max_batch_tokens=32, max_num_seqs=3, exact_reuse=exact_reuse)
    assert _results(got) == _results(fresh.run(_mixed("new", [r.prompt_token_ids for r in new])))
    if exact_reuse:
        assert engine.block_manager.stats.score_store_hits > 0  # scoring read score-store entries (issue 13 item 3)
    if how == "left open":
        with pytest.raises(RuntimeError, match="resumed after a later run"):
            next(left)
