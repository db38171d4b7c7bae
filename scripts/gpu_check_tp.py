"""The 2-GPU part of the GPU check (issue 29): tensor parallelism over NCCL, run only where two CUDA devices exist.

    python3 scripts/gpu_check_tp.py            # on a machine with >= 2 GPUs (else one "skipped" line, exit 0)
    python3 scripts/gpu_check_tp.py --small    # the same checks on the CPU over gloo, tiny shapes (a dry run)

Not part of scripts/gpu_check.py's plan: the machines lent so far have one GPU. Prints JSON lines
{"part": "tp2", "check": ...}; exit 1 when a check fails. The model is a random Llama of the 1B shape in bf16 (Triton
backend), saved as safetensors so that each rank reads only its slices, as `--model DIR --tensor-parallel 2` does:
- agreement: degree 2 against degree 1 on the same prompts (max |d logprob|, ranks and top-K ids that differ);
- exactness: degree 2 bitwise across token budgets 57, 64, 100, 191 and 8192, and each prompt alone;
- generate: 32 greedy tokens at degree 2 against degree 1;
- speed: scoring tokens/s at degree 1 and 2, and rank 0's peak memory (the other rank's is another process's).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_check_common beside this file

from gpu_check_common import IdsTokenizer, columns, emit, llama_config, random_hf_model, random_prompts  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    import numpy as np
    import torch

    from apcscore.config import EngineConfig
    from apcscore.engine.engine import Engine
    from apcscore.engine.loader import native_engine_from_parts
    from apcscore.engine.step import Request, SamplingParams
    from apcscore.models.loading import LazyCheckpoint

    small = "--small" in (argv if argv is not None else sys.argv[1:])
    if not small and torch.cuda.device_count() < 2:
        emit({"part": "tp2", "check": "skipped", "why": f"{torch.cuda.device_count()} CUDA devices, 2 needed"})
        return 0
    device, precision, backend = ("cpu", "float32", "torch") if small else ("cuda", "bfloat16", "triton")
    dtype = getattr(torch, precision)
    cfg = llama_config("llama-3.2-1b", small)
    hf = random_hf_model(cfg, dtype, "cpu")  # saved once; every engine reads the files
    tmp = Path(tempfile.mkdtemp(prefix="apcscore-tp2-"))
    hf.save_pretrained(tmp)
    del hf
    base = dict(device=device, dtype=precision, attention_backend=backend, max_model_len=4096, num_kv_blocks=2048,
                max_batch_tokens=8192, max_num_seqs=64, use_cuda_graphs=False)

    def engine(degree: int, **overrides) -> Engine:
        return native_engine_from_parts(cfg, LazyCheckpoint(tmp, dtype), IdsTokenizer(),
                                        EngineConfig(**{**base, **overrides}, tensor_parallel_size=degree))

    def run(eng: Engine, requests: list) -> dict:
        return {o.request_id: o for o in eng.run(requests)}

    ok = True
    lengths = [16, 40, 23, 70] if small else [64, 130, 300, 700, 1500, 90, 33, 500]
    prompts = random_prompts(lengths, cfg.vocab_size, seed=29)
    reqs = [Request(i, p, prompt_logprobs=5) for i, p in enumerate(prompts)]
    one, two = engine(1), engine(2)
    started = time.perf_counter()
    a = run(one, reqs)
    t1 = time.perf_counter() - started
    started = time.perf_counter()
    b = run(two, reqs)
    t2 = time.perf_counter() - started
    d = max(float(np.abs(a[i].prompt_logprobs.token_logprobs - b[i].prompt_logprobs.token_logprobs).max()) for i in a)
    ranks = sum(int((a[i].prompt_logprobs.ranks != b[i].prompt_logprobs.ranks).sum()) for i in a)
    tops = sum(int((a[i].prompt_logprobs.top_ids != b[i].prompt_logprobs.top_ids).any(axis=1).sum()) for i in a)
    positions = sum(len(a[i].prompt_logprobs.ranks) for i in a)
    emit({"part": "tp2", "check": "agreement", "dtype": precision, "max_abs_logprob_diff": d,
          "ranks_moved": ranks, "top_ids_rows_differ": tops, "positions": positions})
    tokens = sum(lengths)
    emit({"part": "tp2", "check": "speed", "tokens_per_s_degree_1": tokens / t1, "tokens_per_s_degree_2": tokens / t2,
          "peak_gib_rank_0": torch.cuda.max_memory_allocated(0) / 2**30 if not small else None})
    want = {i: columns(o.prompt_logprobs) for i, o in b.items()}
    differ = []
    for label, eng, group in [(str(bud), engine(2, max_batch_tokens=bud), [reqs]) for bud in (57, 64, 100, 191)] + \
            [("alone", two, [[r] for r in reqs])]:
        got = {i: columns(o.prompt_logprobs) for g in group for i, o in run(eng, g).items()}
        if any(not np.array_equal(got[i], want[i]) for i in want):
            differ.append(label)
    emit({"part": "tp2", "check": "exactness", "degree": 2, "budgets_and_alone_differ": differ, "ok": not differ})
    ok &= not differ
    gen = [Request(("g", i), p, sampling=SamplingParams(max_tokens=32, ignore_eos=True)) for i, p in enumerate(prompts)]
    g1, g2 = run(one, gen), run(two, gen)
    same = sum(g1[k].output_token_ids == g2[k].output_token_ids for k in g1)
    emit({"part": "tp2", "check": "generate", "greedy_same_as_degree_1": f"{same}/{len(g1)}"})
    emit({"part": "tp2", "check": "end", "ok": bool(ok)})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
