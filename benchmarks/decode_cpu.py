"""Decode on the CPU, one source tree against another (issue 44, item 3: decode attention without gathers).

    .venv/bin/python benchmarks/decode_cpu.py --trees /path/to/before /path/to/after [--repeats 5]

Two measurements, each tree in its own processes (PYTHONPATH=tree, so its apcscore runs), interleaved:
  attention  the torch backend's decode attention of one engine step, 30 layers, at gsm8k shapes (the default
             model's 9 query heads, 3 KV heads, head_dim 64, block_size 16): `--seqs` sequences behind one shared
             5-shot prefix of ~750 tokens, each with its own question and answer so far (contexts 800..900),
             and the same sequences without a shared prefix (own blocks). Median of the repeats.
  generate   a gsm8k-shaped generation: `--seqs` prompts (lm-eval's gsm8k layout, 5 shots then the question,
             lmeval_data's synthetic problems), `--max-new` greedy tokens each, end of sequence ignored, through
             benchmarks/workers.py (the Engine, prefix caching on). Median whole-process wall time and compute
             time; the generated tokens must be the same in every tree and run (the bits may not move).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
HQ, HKV, D, BS, LAYERS = 9, 3, 64, 16, 30


def gsm8k_prompts(n: int, seed: int = 0) -> list[str]:
    """lm-eval gsm8k's 5-shot layout ("Question: ...\\nAnswer: ...", the same 5 shots first) on lmeval_data's
    synthetic problems."""
    sys.path.insert(0, str(HERE))
    from lmeval_data import gsm8k

    rng = random.Random(seed)
    shots = "".join(f"Question: {d['question']}\nAnswer: {d['answer']}\n\n" for d in (gsm8k(rng, i) for i in range(5)))
    return [shots + f"Question: {gsm8k(rng, 5 + i)['question']}\nAnswer:" for i in range(n)]


def attention_child(seqs: int, repeats: int) -> None:
    """In a tree's process: per-step decode attention times (30 layers), printed as one JSON line."""
    import torch

    from apcscore.attention import torch_backend as tb
    from apcscore.attention.metadata import AttentionMetadata

    g = torch.Generator().manual_seed(0)
    lens = [800 + (i * 37) % 100 for i in range(seqs)]
    out = {}
    for name, shared in (("shared 5-shot prefix", 47), ("no shared prefix", 0)):
        own = [-(-n // BS) - shared for n in lens]
        blocks = shared + sum(own) + 1
        k, v = tb.allocate_kv_cache(1, blocks, BS, HKV, D, torch.zeros)[0]
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
        perm = (torch.randperm(blocks - 1 - shared, generator=g) + 1 + shared).tolist()
        tables, p = [], 0
        for b in own:
            tables.append(list(range(1, shared + 1)) + perm[p:p + b])
            p += b
        q = torch.randn(seqs, HQ, D, generator=g)
        times = []
        for _ in range(repeats + 1):  # the first: warm-up
            meta = AttentionMetadata.for_attention([(1, n) for n in lens], tables, BS)  # a new step: a new plan
            t = time.perf_counter()
            for _layer in range(LAYERS):
                tb.paged_attention(q, k, v, meta, D ** -0.5)
            times.append(time.perf_counter() - t)
        out[name] = times[1:]
    print(json.dumps(out))


def run_tree(tree: str, argv: list[str]) -> tuple[float, str]:
    env = {**os.environ, "PYTHONPATH": tree}
    t = time.perf_counter()
    res = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, cwd=tree)
    wall = time.perf_counter() - t
    if res.returncode:
        raise SystemExit(f"{tree}: {' '.join(argv)} failed:\n{res.stderr[-3000:]}")
    return wall, res.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", nargs=2, required=True, metavar=("BEFORE", "AFTER"), help="two source trees")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--skip", choices=["attention", "generate"], action="append", default=[])
    args = ap.parse_args()
    trees = [str(Path(t).resolve()) for t in args.trees]
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")
    print(f"CPU: {cpu}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    if "attention" not in args.skip:
        per: dict[str, dict[str, list[float]]] = {t: {} for t in trees}
        for r in range(args.repeats):
            for tree in trees if r % 2 == 0 else trees[::-1]:  # interleaved, alternating first
                _, out = run_tree(tree, [str(Path(__file__).resolve()), "attention-child", str(args.seqs), "3"])
                for name, ts in json.loads(out).items():
                    per[tree].setdefault(name, []).extend(ts)
        for name in per[trees[0]]:
            a, b = (statistics.median(per[t][name]) for t in trees)
            print(f"decode attention, {args.seqs} seqs, contexts 800..900, {name}, 30 layers: "
                  f"before {a * 1000:.1f} ms, after {b * 1000:.1f} ms, after/before {b / a:.2f}x", flush=True)
    if "generate" not in args.skip:
        from transformers import AutoTokenizer

        from apcscore.models.locate import resolve_model

        tok = AutoTokenizer.from_pretrained(resolve_model(args.model)[0])
        work = Path(tempfile.mkdtemp(prefix="decode_cpu-"))
        data = work / "gsm8k.jsonl"
        with open(data, "w") as f:
            for i, text in enumerate(gsm8k_prompts(args.seqs)):
                f.write(json.dumps({"id": str(i), "prompt_token_ids": tok(text).input_ids}) + "\n")
        walls: dict[str, list[float]] = {t: [] for t in trees}
        computes: dict[str, list[float]] = {t: [] for t in trees}
        tokens = []
        for r in range(args.repeats):
            for tree in trees if r % 2 == 0 else trees[::-1]:
                npz = work / f"out{len(tokens)}.npz"
                wall, out = run_tree(tree, [str(HERE / "workers.py"), "--side", "apcscore", "--task", "generate",
                                            "--data", str(data), "--output", str(npz), "--model", args.model,
                                            "--max-new-tokens", str(args.max_new)])
                report = json.loads(out.split("BENCH_REPORT ", 1)[1].splitlines()[0])
                walls[tree].append(wall)
                computes[tree].append(report["compute_s"])
                import numpy as np

                tokens.append(np.load(npz)["tokens"])
                print(f"  {Path(tree).name}: wall {wall:.1f} s, compute {report['compute_s']:.1f} s, "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
        same = all((t == tokens[0]).all() for t in tokens)
        (a, b), (ca, cb) = ([statistics.median(x[t]) for t in trees] for x in (walls, computes))
        print(f"gsm8k-shaped generate, {args.seqs} prompts x {args.max_new} tokens: whole process before {a:.1f} s, "
              f"after {b:.1f} s ({b / a:.2f}x); compute before {ca:.1f} s, after {cb:.1f} s ({cb / ca:.2f}x); "
              f"generated tokens identical in all {len(tokens)} runs: {same}")
        if not same:
            raise SystemExit("the trees generated different tokens")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "attention-child":
        attention_child(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
