"""One benchmark contender in one process: apcscore's Engine or plain transformers, on the same weights.

    python benchmarks/workers.py --side apcscore|transformers --task score|generate \
        --data INPUTS.jsonl --output OUT.npz [--model smollm2-135m] [--k 5] [--batch-size 8] \
        [--max-new-tokens 32] [--profile OUT.prof]

INPUTS.jsonl holds records {"id": str, "prompt_token_ids": [int, ...]} (the same file `apcscore score`
reads). Both sides do the same work and return the same things as Python lists:

- score: for every prompt token after the first, its logprob (fp32 log_softmax), rank (1 = argmax) and
  the top-K ids and logprobs. transformers: records sorted by length, batches of `--batch-size`, right
  padding with an attention mask, one forward per batch.
- generate: `--max-new-tokens` greedy tokens per prompt, end-of-sequence ignored. transformers:
  `generate()` in batches of `--batch-size` with left padding.

The last stdout line is `BENCH_REPORT {json}`: import_s, load_s, compute_s, peak_rss_mb (ru_maxrss of
this process) and peak_rss_after_load_mb, threads, and `output`, an .npz of the results (written after the
timed part) that the driver compares across sides.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

REPORT_PREFIX = "BENCH_REPORT "

# One scored record: per-token logprob, rank, top-K ids, top-K logprobs (lists, position 1 onwards).
Scored = tuple[list[float], list[int], list[list[int]], list[list[float]]]


def read_records(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ---- apcscore -----------------------------------------------------------------------------------
def apcscore_load(model: str, batch_invariant: bool = True) -> Any:
    from apcscore.config import EngineConfig
    from apcscore.engine import load_engine

    return load_engine(model, EngineConfig(device="cpu", dtype="float32", batch_invariant=batch_invariant))


def apcscore_score(engine: Any, records: list[dict], k: int) -> list[Scored]:
    from apcscore.engine.step import Request

    requests = [Request(i, r["prompt_token_ids"], prompt_logprobs=k) for i, r in enumerate(records)]
    results: list[Scored | None] = [None] * len(records)
    for out in engine.run(requests):
        if out.error:
            raise RuntimeError(f"record {records[out.request_id]['id']}: {out.error}")
        lp = out.prompt_logprobs
        results[out.request_id] = (lp.token_logprobs.tolist(), lp.ranks.tolist(), lp.top_ids.tolist(),
                                   lp.top_logprobs.tolist())
    return results  # type: ignore[return-value]


def apcscore_generate(engine: Any, records: list[dict], max_new: int) -> list[list[int]]:
    from apcscore.engine.step import Request, SamplingParams

    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    requests = [Request(i, r["prompt_token_ids"], sampling=params) for i, r in enumerate(records)]
    results: list[list[int]] = [[] for _ in records]
    for out in engine.run(requests):
        if out.error:
            raise RuntimeError(f"record {records[out.request_id]['id']}: {out.error}")
        results[out.request_id] = list(out.output_token_ids)
    return results


# ---- transformers -------------------------------------------------------------------------------
def transformers_load(model: str) -> Any:
    from transformers import AutoModelForCausalLM

    from apcscore.models.locate import resolve_model

    hf = AutoModelForCausalLM.from_pretrained(resolve_model(model)[0], dtype=torch.float32)
    return hf.eval()


@torch.inference_mode()
def transformers_score(model: Any, records: list[dict], k: int, batch_size: int, pad_id: int) -> list[Scored]:
    results: list[Scored | None] = [None] * len(records)
    order = sorted(range(len(records)), key=lambda i: len(records[i]["prompt_token_ids"]))
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        seqs = [records[i]["prompt_token_ids"] for i in idx]
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # [B, L], right padding
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, s in enumerate(seqs):
            ids[row, :len(s)] = torch.tensor(s)
            mask[row, :len(s)] = 1
        logits = model(input_ids=ids, attention_mask=mask).logits  # [B, L, V]
        valid = mask[:, 1:].bool()  # position q predicts token q + 1
        rows = logits[:, :-1][valid].float()  # [N, V], real positions only
        targets = ids[:, 1:][valid]  # [N]
        del logits
        logprobs = torch.log_softmax(rows, dim=-1)  # [N, V] fp32
        del rows
        own = logprobs.gather(1, targets[:, None])[:, 0]  # [N]
        ranks = (logprobs > own[:, None]).sum(-1) + 1
        top_lp, top_ids = logprobs.topk(k, dim=-1)  # [N, K]
        del logprobs
        counts = [len(s) - 1 for s in seqs]
        for i, lp, rk, ti, tl in zip(idx, own.split(counts), ranks.split(counts), top_ids.split(counts),
                                     top_lp.split(counts)):
            results[i] = (lp.tolist(), rk.tolist(), ti.tolist(), tl.tolist())
    return results  # type: ignore[return-value]


@torch.inference_mode()
def transformers_generate(model: Any, records: list[dict], max_new: int, batch_size: int,
                          pad_id: int) -> list[list[int]]:
    results: list[list[int]] = []
    for b in range(0, len(records), batch_size):
        seqs = [r["prompt_token_ids"] for r in records[b:b + batch_size]]
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # [B, L], left padding
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, s in enumerate(seqs):
            ids[row, width - len(s):] = torch.tensor(s)
            mask[row, width - len(s):] = 1
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                             min_new_tokens=max_new, pad_token_id=pad_id)  # [B, L + max_new]
        results += out[:, width:].tolist()
    return results


# ---- outputs ------------------------------------------------------------------------------------
def save_scored(path: Path, records: list[dict], results: list[Scored], k: int) -> None:
    """Concatenate every record's rows (dataset order); `lengths` splits them back."""
    lengths = np.array([len(r[0]) for r in results], np.int64)
    np.savez(path, ids=np.array([r["id"] for r in records]), lengths=lengths,
             logprobs=np.array([x for r in results for x in r[0]], np.float32),
             ranks=np.array([x for r in results for x in r[1]], np.int64),
             top_ids=np.array([x for r in results for x in r[2]], np.int64).reshape(-1, k),
             top_logprobs=np.array([x for r in results for x in r[3]], np.float32).reshape(-1, k))


def save_generated(path: Path, records: list[dict], results: list[list[int]]) -> None:
    np.savez(path, ids=np.array([r["id"] for r in records]), tokens=np.array(results, np.int64))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--side", choices=["apcscore", "transformers"], required=True)
    ap.add_argument("--task", choices=["score", "generate"], required=True)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--output", type=Path, required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--no-batch-invariant", action="store_true", help="apcscore: library GEMMs (the tax contender)")
    ap.add_argument("--profile", type=Path, help="cProfile the compute phase into this file")
    args = ap.parse_args(argv)

    import_s = time.perf_counter() - T_START
    records = read_records(args.data)
    t0 = time.perf_counter()
    if args.side == "apcscore":
        engine = apcscore_load(args.model, batch_invariant=not args.no_batch_invariant)
        pad_id = 0
    else:
        engine = transformers_load(args.model)
        pad_id = engine.generation_config.pad_token_id
        pad_id = 0 if pad_id is None else int(pad_id)
    load_s = time.perf_counter() - t0
    rss_after_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t0 = time.perf_counter()
    if args.task == "score":
        results: Any = (apcscore_score(engine, records, args.k) if args.side == "apcscore"
                        else transformers_score(engine, records, args.k, args.batch_size, pad_id))
    else:
        results = (apcscore_generate(engine, records, args.max_new_tokens) if args.side == "apcscore"
                   else transformers_generate(engine, records, args.max_new_tokens, args.batch_size, pad_id))
    compute_s = time.perf_counter() - t0
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(str(args.profile))

    if args.task == "score":
        save_scored(args.output, records, results, args.k)
    else:
        save_generated(args.output, records, results)
    report = {"side": args.side, "task": args.task, "import_s": round(import_s, 3), "load_s": round(load_s, 3),
              "compute_s": round(compute_s, 3), "threads": torch.get_num_threads(),
              "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
              "peak_rss_after_load_mb": round(rss_after_load, 1),
              "output": str(args.output)}
    if args.side == "apcscore":
        s = engine.stats
        report["engine"] = {"steps": s.steps, "prompt_tokens": s.prompt_tokens,
                            "generated_tokens": s.generated_tokens, "preemptions": s.preemptions,
                            "num_kv_blocks": engine.block_manager.num_blocks,
                            "cached_tokens": engine.block_manager.stats.hit_tokens}
    print(REPORT_PREFIX + json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
