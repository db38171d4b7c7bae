"""GPU check parts `eval`, `8b`, `reference` and `long` (see scripts/gpu_check.py for the plan).

eval: lm-eval-shaped work on synthetic token ids, on the Llama-3.2-1B shape. 5-shot multiple choice (a shared
    ~350-token prefix, 1,000 questions x 4 one-token choices) the way apcscore's lm-eval backend asks for it
    (one request per context, the choices as last-token alternatives: `group_by_last_token`), recomputed and
    with --exact-reuse, against transformers batched like lm-eval's `hf` (contexts sorted by length, batches
    of 32, right padding, log_softmax over the batch's logits); and a 64-token-continuation task without a
    shared prefix (256 requests), the same two ways.
8b: a Llama-3.1-8B shape with random weights built on the device: scoring throughput and MFU, and greedy
    generation of 256 prompts x 512 new tokens.
reference: `score --reference-model` on a pair of 8B shapes in bf16: the cost against the candidate alone, the
    peak memory, the KL columns bitwise one prompt at a time and batched.
long: 16 prompts of 8,192 and 4 of 32,768 tokens on the 1B shape, prompt logprobs at K=20 over a 128k
    vocabulary: tokens/s and peak memory per group; fails on an error (an OOM) or a non-finite logprob.
"""

from __future__ import annotations

from typing import Any

from gpu_check_common import (SCORE_SHAPE, emit, engine_and_state, engine_generate, engine_score, make_engine,
                              matmul_params, mfu, peak_memory_gib, random_prompts, rounded, score_lengths,
                              score_workload, sync, timed)

HF_BATCH = 32  # lm-eval `--batch_size 32`


def hf_loglikelihoods(model, rows: list[tuple[list[int], list[list[int]]]]) -> list[list[tuple[float, bool]]]:
    """lm-eval hf's loglikelihood on token ids: per (context, continuations of one length) row, one forward of
    (context + continuation)[:-1] per distinct input (one-token choices share one: the context); batches of
    HF_BATCH sorted by length (longest first), right-padded, no attention mask (causal: padding comes after);
    log_softmax over the whole logits [b, L, V]. Returns per row, per continuation: (sum of logprobs, greedy)."""
    import torch

    dev = next(model.parameters()).device
    inputs = [ctx + conts[0][:-1] for ctx, conts in rows]  # one-token choices: the context itself
    order = sorted(range(len(rows)), key=lambda i: -len(inputs[i]))
    out: list[list[tuple[float, bool]] | None] = [None] * len(rows)
    with torch.inference_mode():
        for s in range(0, len(order), HF_BATCH):
            idx = order[s:s + HF_BATCH]
            width = len(inputs[idx[0]])
            ids = torch.zeros(len(idx), width, dtype=torch.long)  # [b, L], right padding with 0
            for r, i in enumerate(idx):
                ids[r, :len(inputs[i])] = torch.tensor(inputs[i])
            logprobs = torch.log_softmax(model(ids.to(dev)).logits, dim=-1)  # [b, L, V] in the model's dtype
            for r, i in enumerate(idx):
                ctx, conts = rows[i]
                n = len(conts[0])
                lp = logprobs[r, len(ctx) - 1:len(ctx) - 1 + n]  # [n, V]: the rows that predict the continuation
                target = torch.tensor(conts, device=dev)  # [choices, n]
                got = lp[torch.arange(n, device=dev)[None, :], target]  # [choices, n]
                greedy = (lp.argmax(-1)[None, :] == target).all(-1)  # [choices]
                out[i] = list(zip(got.float().sum(-1).tolist(), greedy.tolist()))
            del logprobs
    return out  # type: ignore[return-value]


def engine_loglikelihoods(engine, rows: list[tuple[list[int], list[list[int]]]]) -> list[list[tuple[float, bool]]]:
    """The lm-eval backend's path (apcscore/lmeval/model.py): one scoring request per continuation (top-1, no
    ranks), merged by group_by_last_token, read with continuation_score. Per row, per continuation."""
    from apcscore.engine.step import Request
    from apcscore.jobs.loglikelihood import continuation_score, group_by_last_token

    separate = [Request(None, ctx + cont, prompt_logprobs=1, score_from=len(ctx), prompt_logprob_ranks=False)
                for ctx, conts in rows for cont in conts]
    merged, owner = group_by_last_token(separate)
    for i, r in enumerate(merged):
        r.request_id = i
    outs = {o.request_id: o for o in engine.run(merged)}
    bad = [o.error for o in outs.values() if o.error]
    if bad:
        raise RuntimeError(f"engine errors: {bad[:3]}")
    scores = [continuation_score(outs[o], last_token=r.prompt_token_ids[-1]) for r, o in zip(separate, owner)]
    it = iter(scores)
    return [[(s.logprob, s.is_greedy) for s in (next(it) for _ in conts)] for _, conts in rows]


def agreement(a: list[list[tuple[float, bool]]], b: list[list[tuple[float, bool]]]) -> dict[str, Any]:
    """Max |d loglikelihood|, greedy flags equal, and how often the argmax choice is the same."""
    d = max(abs(x[0] - y[0]) for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    greedy = sum(x[1] == y[1] for ra, rb in zip(a, b) for x, y in zip(ra, rb)) / sum(len(r) for r in a)
    pick = sum(max(range(len(ra)), key=lambda j: ra[j][0]) == max(range(len(rb)), key=lambda j: rb[j][0])
               for ra, rb in zip(a, b)) / len(a)
    return {"max_abs_loglikelihood_diff": rounded(d), "greedy_flag_agree": rounded(greedy),
            "same_choice": rounded(pick)}


def part_eval(args) -> bool:
    """Few-shot multiple choice and 64-token continuations; fails if --exact-reuse is not bitwise recompute."""
    import numpy as np

    small = args.small
    cfg, state, precision, backend, device, hf = engine_and_state("llama-3.2-1b", small)  # the same weights
    vocab = cfg.vocab_size
    tag = {"part": "eval", "model": "llama-3.2-1b-" + ("tiny" if small else "shape"), "dtype": precision}
    rng = np.random.default_rng(31)
    n_q, prefix_len, q_len = (24, 40, (5, 20)) if small else (1000, 350, (20, 60))
    prefix = rng.integers(0, vocab, prefix_len).tolist()
    mc = [(prefix + rng.integers(0, vocab, int(rng.integers(*q_len))).tolist(),
           [[int(t)] for t in rng.choice(vocab, 4, replace=False)]) for _ in range(n_q)]
    warm = [(rng.integers(0, vocab, 50).tolist(), [[1], [2]]) for _ in range(4)]
    ok = True
    results: dict[str, Any] = {}
    for name, overrides in (("recompute", {}), ("exact_reuse", {"exact_reuse": True})):
        engine = make_engine(cfg, state, device, precision, backend, **overrides)
        engine_loglikelihoods(engine, warm)  # compile outside the timing (another prefix: no cache hits)
        warm_tokens = engine.stats.prompt_tokens
        results[name], secs = timed(lambda: engine_loglikelihoods(engine, mc))
        results[name + "_s"] = secs
        results[name + "_prompt_tokens"] = engine.stats.prompt_tokens - warm_tokens  # the timed run's
        del engine
    hf_loglikelihoods(hf, warm)
    results["hf"], results["hf_s"] = timed(lambda: hf_loglikelihoods(hf, mc))
    bitwise = results["exact_reuse"] == results["recompute"]
    ok &= bitwise
    emit({**tag, "task": "5-shot multiple choice", "questions": n_q, "choices": 4, "shared_prefix": prefix_len,
          "tokens": sum(len(c) + 1 for c, _ in mc),
          "seconds": {k: rounded(results[k + "_s"]) for k in ("recompute", "exact_reuse", "hf")},
          "time_vs_hf": {k: rounded(results[k + "_s"] / results["hf_s"], 3) for k in ("recompute", "exact_reuse")},
          "engine_prompt_tokens": {k: results[k + "_prompt_tokens"] for k in ("recompute", "exact_reuse")},
          "exact_reuse_bitwise_recompute": bitwise, "vs_hf": agreement(results["recompute"], results["hf"])})

    # 64-token continuations of contexts of 100..900 tokens, no shared prefix
    n_c, lo, hi, cont_len = (8, 10, 40, 8) if small else (256, 100, 900, 64)
    contexts = random_prompts(score_lengths(n_c, lo, hi, seed=32), vocab, seed=33)
    rows = [(ctx, [rng.integers(0, vocab, cont_len).tolist()]) for ctx in contexts]
    engine = make_engine(cfg, state, device, precision, backend)
    engine_loglikelihoods(engine, warm)
    ours, t_ours = timed(lambda: engine_loglikelihoods(engine, rows))
    theirs, t_hf = timed(lambda: hf_loglikelihoods(hf, rows))
    tokens = sum(len(c) + cont_len for c in contexts)
    emit({**tag, "task": f"{cont_len}-token continuations", "requests": n_c, "tokens": tokens,
          "seconds": {"apcscore": rounded(t_ours), "hf": rounded(t_hf)},
          "tokens_per_s": {"apcscore": round(tokens / t_ours), "hf": round(tokens / t_hf)},
          "time_vs_hf": rounded(t_ours / t_hf, 3), "vs_hf": agreement(ours, theirs)})
    return bool(ok)


def part_8b(args) -> None:
    """Llama-3.1-8B shape: score 128 prompts of 64..2048 tokens (K=5) and generate 256 x 512 greedy tokens."""
    import torch

    small = args.small
    cfg, state, precision, backend, device, hf = engine_and_state("llama-3.1-8b", small)
    n_gen, prompt_len, new = (8, 16, 16) if small else (256, 128, 512)
    blocks = n_gen * -(-(prompt_len + new) // 16) + 512
    engine = make_engine(cfg, state, device, precision, backend, max_num_seqs=256, num_kv_blocks=blocks)
    del state, hf  # the engine holds its own copy; the random model's weights go
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()  # the peaks below are the engine's, not the load's (two copies)
    params = matmul_params(engine)
    tag = {"part": "8b", "model": "llama-3.1-8b-" + ("tiny" if small else "shape"), "dtype": precision,
           "backend": backend, "params": engine.info.num_parameters, "mfu_params": params}
    n_prompts, lo, hi = SCORE_SHAPE[small]
    prompts = score_workload(cfg.vocab_size, small)
    engine_score(engine, random_prompts([lo, hi], cfg.vocab_size, seed=3), 5)  # compile outside the timing
    tokens = sum(len(p) for p in prompts)
    _, secs = timed(lambda: engine_score(engine, prompts, 5))
    emit({**tag, "task": "score", "prompts": n_prompts, "tokens": tokens, "k": 5, "seconds": rounded(secs),
          "tokens_per_s": round(tokens / secs), "mfu": mfu(params, tokens, secs),
          "peak_memory_gib": peak_memory_gib()})
    gen_prompts = random_prompts([prompt_len] * n_gen, cfg.vocab_size, seed=4)
    engine_generate(engine, gen_prompts[:4], 4)
    preemptions0 = engine.stats.preemptions
    _, secs = timed(lambda: engine_generate(engine, gen_prompts, new))
    emit({**tag, "task": "generate", "prompts": n_gen, "prompt_tokens_each": prompt_len, "new_tokens_each": new,
          "seconds": rounded(secs), "generated_tokens_per_s": round(n_gen * new / secs),
          "peak_memory_gib": peak_memory_gib(), "preemptions": engine.stats.preemptions - preemptions0})


def part_long(args) -> bool:
    """Long prompts at K=20 on the 1B shape: 16 x 8,192 then 4 x 32,768 tokens, one engine."""
    import numpy as np
    import torch

    small = args.small
    groups = [(4, 256), (2, 1024)] if small else [(16, 8192), (4, 32768)]
    longest = max(n for _, n in groups)
    cfg, state, precision, backend, device, hf = engine_and_state("llama-3.2-1b", small)
    blocks = max(c * n for c, n in groups) // 16 + 256  # every prompt of a group fits at once: no preemption
    engine = make_engine(cfg, state, device, precision, backend, max_model_len=longest + 16, num_kv_blocks=blocks)
    del state, hf
    engine_score(engine, random_prompts([300], cfg.vocab_size, seed=40), 20)  # compile outside the timing
    ok = True
    for i, (count, length) in enumerate(groups):
        prompts = random_prompts([length] * count, cfg.vocab_size, seed=41 + i)
        if device == "cuda":
            sync()
            torch.cuda.reset_peak_memory_stats()
        out, secs = timed(lambda: engine_score(engine, prompts, 20))
        finite = all(np.isfinite(o.token_logprobs).all() and np.isfinite(o.top_logprobs).all() for o in out)
        complete = all(len(o.token_logprobs) == length - 1 and o.top_ids.shape[1] == 20 for o in out)
        ok &= finite and complete
        tokens = count * length
        emit({"part": "long", "model": "llama-3.2-1b-" + ("tiny" if small else "shape"), "dtype": precision,
              "vocab": cfg.vocab_size, "prompts": count, "tokens_each": length, "k": 20, "seconds": rounded(secs),
              "tokens_per_s": round(tokens / secs), "peak_memory_gib": peak_memory_gib(),
              "max_batch_tokens": engine.config.max_batch_tokens, "finite": bool(finite), "complete": complete,
              "ok": bool(finite and complete)})
        del out
    return bool(ok)



def part_reference(args) -> bool:
    """`score --reference-model` on two Llama-3.1-8B shapes in bf16 on one GPU (issue 55): the candidate (the
    reference's weights times 1 + 1% noise) scored alone, then with the reference beside it (both pools the same
    size, as engine/loader.load_paired_engine builds them); the time ratio, the peak memory, and on CUDA the KL
    columns bitwise the same for prompts scored one at a time as in the batch. Fails on a non-finite or negative
    KL, or a differing bit."""
    import numpy as np
    import torch

    from apcscore.engine.reference import pair

    small = args.small
    cfg, state, precision, backend, device, hf = engine_and_state("llama-3.1-8b", small)
    pool = dict(num_kv_blocks=2048, use_cuda_graphs=False)  # 32k tokens per model: the step's, not the dataset's
    reference = make_engine(cfg, state, device, precision, backend, **pool)
    generator = torch.Generator(device=device).manual_seed(5)
    with torch.no_grad():
        for tensor in state.values():  # the candidate: every weight times (1 + 0.01 N(0, 1)), in place
            tensor.mul_(1 + 0.01 * torch.randn(tensor.shape, generator=generator, device=device, dtype=tensor.dtype))
    candidate = make_engine(cfg, state, device, precision, backend, **pool)
    del state, hf
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    n_prompts, lo, hi = (8, 16, 128) if small else (32, 64, 2048)
    prompts = random_prompts(score_lengths(n_prompts, lo, hi, seed=50), cfg.vocab_size, seed=51)
    tokens = sum(len(p) for p in prompts)
    engine_score(candidate, prompts[:2], 5)  # compile outside the timing
    _, alone = timed(lambda: engine_score(candidate, prompts, 5))
    pair(candidate, reference)
    engine_score(candidate, prompts[:2], 5)
    outs, paired = timed(lambda: engine_score(candidate, prompts, 5))
    kl = np.concatenate([o.divergence.kl for o in outs])
    one_at_a_time = [engine_score(candidate, [p], 5)[0].divergence for p in prompts[:4]]
    bitwise = all(np.array_equal(a.kl.view(np.int64), o.divergence.kl.view(np.int64))
                  and np.array_equal(a.delta_p.view(np.int64), o.divergence.delta_p.view(np.int64))
                  for a, o in zip(one_at_a_time, outs))
    ok = bool(np.isfinite(kl).all() and (kl >= -1e-12).all() and bitwise)
    emit({"part": "reference", "model": "llama-3.1-8b-" + ("tiny" if small else "shape") + " pair", "task": "score",
          "dtype": precision, "backend": backend, "prompts": n_prompts, "tokens": tokens, "k": 5,
          "seconds_alone": rounded(alone), "seconds": rounded(paired), "ratio": round(paired / alone, 3),
          "tokens_per_s": round(tokens / paired), "mean_kl": float(kl.mean()), "peak_memory_gib": peak_memory_gib(),
          "bitwise_one_at_a_time": bitwise, "ok": ok})
    return ok
