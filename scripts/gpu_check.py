"""GPU check: every GPU measurement of apcscore in one call, printed as JSON lines, plus a Markdown summary.

    python3 scripts/gpu_check.py [--small]            # the plan: every part, each in its own process
    python3 scripts/gpu_check.py --only tests,tax     # those parts of the plan, in its order (a short lease)
    python3 scripts/gpu_check.py PART [--model NAME] [--small]   # one part (also compare, bench:smollm2-135m)

scripts/gpu_check.sh is the entry point (it sets PYTHONPATH and the overall limit). The plan, most valuable
first (a part cut short by its limit keeps the lines it printed; later parts still run):

- env         versions, device, and whether apcscore imports without `datasets` / `gguf` (absent there).
- tests       `pytest -m "gpu or triton"` (TRITON_INTERPRET unset: the kernels and engines run on CUDA).
- sweep       Triton matmul configurations per (N, K) of the 1B, 8B and SmolLM2-135M shapes at M = 256, 2048,
              8192, and the proposed table for apcscore/kernels/matmul_configs.py. The parts after it run
              with that proposal in the table (their end lines say how many entries): what a lease would commit
              is what exactness, the tax and the benchmarks measure.
- exactness   bitwise contracts end to end on the 1B shape in bf16: token budgets 57/64/100/191 and each prompt
              alone vs budget 8192; --exact-reuse (context reuse, score store) vs recompute; last-token
              alternatives vs separate requests; greedy generation alone, batched, eager, preempted.
- tax         the invariance tax: the same score and generate workloads with batch invariance on and off
              (cuBLAS), one after the other in one process; the time ratio.
- bench       apcscore against plain transformers (bf16, SDPA) on the same random weights, 1B shape: prompt
              logprobs (K=5, 64..2048 tokens) with model FLOP utilisation, and generation (256 prompts sharing a
              1,024-token prefix, 64 greedy tokens each).
- eval        5-shot multiple choice (350-token shared prefix, 1,000 questions x 4 one-token choices): recompute,
              --exact-reuse and transformers batched like lm-eval's hf; 64-token continuations, no shared prefix.
- 8b          a Llama-3.1-8B shape built on the device: score tokens/s and MFU, generation of 256 x 512 tokens.
- reference   `score --reference-model`: two 8B shapes (the candidate the reference's weights with 1% noise) in bf16
              on one GPU: time against the candidate alone, peak memory, the KL bitwise alone vs batched.
- long        16 x 8,192 and 4 x 32,768-token prompts at K=20 (vocabulary 128k): tokens/s, peak memory.
- profile     the tax's score and generate workloads under torch.profiler, invariant and cuBLAS: the GPU's busy
              share of the wall time and kernel time by group (matmul, attention, logprobs, ...), top kernels.

Parts live in gpu_check_basic.py (env, tests, compare, bench), gpu_check_exact.py (exactness, tax),
gpu_check_sweep.py (sweep), gpu_check_scale.py (eval, 8b, long) and gpu_check_profile.py (profile);
gpu_check_common.py holds the models and workloads, gpu_check_summary.py the Markdown summary
($OUT/gpu_check_summary.md, ready for docs/benchmarks.md).
MFU is 2 x params x tokens / s / 989e12 (H100/H200 dense bf16), params those a token is multiplied by
(gpu_check_common.matmul_params: a tied embedding counts as the LM head, an untied one, a lookup, not at all).
`--small` (GPU_CHECK_SMALL=1, or gpu_check.sh --dry-run) runs every part end to end on the CPU in fp32 with
tiny shapes: the torch backend for the engines, the Triton interpreter for the compare and sweep parts.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the gpu_check_* modules beside this file

from gpu_check_basic import part_bench, part_compare, part_env, part_tests  # noqa: E402
from gpu_check_common import PART_DEADLINE_ENV, ROOT, SHAPES  # noqa: E402
from gpu_check_exact import part_exactness, part_tax  # noqa: E402
from gpu_check_profile import part_profile  # noqa: E402
from gpu_check_scale import part_8b, part_eval, part_long, part_reference  # noqa: E402
from gpu_check_summary import write_summary  # noqa: E402
from gpu_check_sweep import SWEPT_TABLE_ENV, apply_swept_table, part_sweep, read_table  # noqa: E402

TOTAL_LIMIT_S = 540  # the whole check stays under 9 minutes (gpu_check.sh's backstop is 555 s)
# Run 1 on the H200 (docs/gpu_runs/2026-12-01-h200-run1.jsonl) took env 9, tests 55, bench (1B) 26 s, and its
# invariance part (budgets, tax) 22 s; each part process also pays ~5-8 s of imports and CUDA start-up.
# tests: above 120 s, the longest subprocess timeout of a gpu/triton test (the Hopper AOT compile).
# Run 2 (2026-12-04, docs/gpu_runs/2026-12-04-h200-run2.jsonl) took 255 s in all: env 10, tests 74, sweep 20,
# exactness 23, tax 25, bench 29, eval 26, 8b 31, long 18 s; the limits keep >= 1.7x of that (tests: the AOT
# compile's 120 s), which left 45 s for the profile.
# The sweep runs before the engine parts: they run with its proposal (the table a lease would commit), so one
# lease measures exactness, the tax and MFU with it (a shape it proposes DEFAULT for runs DEFAULT). Without a
# sweep (--only without it) they run the committed table.
# Issue 45 added two checks to exactness (silu_mul; the shared-prefix decode groups: two more kernels to compile,
# three timed caps, a warm generation run): about 15-20 s more by estimate, so exactness gets 15 s of the sweep's.
# Issue 55 added `reference` (two 8B shapes built and 32 prompts scored twice: ~25 s by estimate, no run yet): its
# 35 s come from the sweep (55 -> 45; it took 20), eval (45 -> 40; 26), 8b (55 -> 50; 31) and the profile (45 -> 30).
PART_LIMITS_S = {"env": 15, "tests": 125, "sweep": 45, "exactness": 70, "tax": 50, "bench:llama-3.2-1b": 50,
                 "eval": 40, "8b": 50, "reference": 35, "long": 30, "profile": 30}
SMALL_LIMITS_S = {"env": 60, "tests": 180, "sweep": 180, "exactness": 180, "tax": 120, "bench:llama-3.2-1b": 120,
                  "eval": 180, "8b": 120, "reference": 120, "long": 120, "profile": 120}
WITHOUT_TABLE = {"env", "tests", "sweep"}  # parts that set their own matmul configurations (or none)
# parts whose Triton kernels run under TRITON_INTERPRET=1 in --small (exactness: its silu_mul check; its engines
# take the torch backend there)
INTERPRETED = {"sweep", "exactness"}

PARTS = {"env": part_env, "tests": part_tests, "compare": part_compare, "bench": part_bench,
         "exactness": part_exactness, "tax": part_tax, "sweep": part_sweep, "eval": part_eval, "8b": part_8b,
         "reference": part_reference, "long": part_long, "profile": part_profile}


def part_argv(label: str) -> list[str]:
    """A plan label ("bench:llama-3.2-1b") as the part's command line."""
    name, _, model = label.partition(":")
    return [name, "--model", model] if model else [name]


def run_part(argv: list[str], label: str, limit: float, env: dict[str, str], log,
             collected: list[str], extra: dict[str, Any]) -> dict[str, Any]:
    """Run one part in its own process group under `limit` seconds; pass its JSON lines through. `extra` goes
    into its end line."""
    t0 = time.perf_counter()
    env = {**env, PART_DEADLINE_ENV: str(time.time() + limit)}  # a part that can stop itself in time reads it
    proc = subprocess.Popen([sys.executable, __file__, *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
    reader.start()
    lines = 0

    def pump() -> None:
        nonlocal lines
        for line in proc.stdout:
            line = line.strip()
            if line.startswith("{"):
                lines += 1
                write(line, log, collected)
            elif line:
                err.append(line + "\n")

    pumper = threading.Thread(target=pump, daemon=True)
    pumper.start()
    timed_out = False
    try:
        proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    pumper.join(timeout=5)
    reader.join(timeout=5)
    status = {"part": "end", "name": label, "rc": proc.returncode, "timed_out": timed_out, "limit_s": round(limit),
              "seconds": round(time.perf_counter() - t0, 1), "json_lines": lines, **extra}
    if proc.returncode != 0:
        status["stderr_tail"] = "".join(err)[-3000:]
    write(json.dumps(status), log, collected)
    return status


def write(line: str, log, lines: list[str]) -> None:
    """A JSON line to stdout, the log ($OUT/gpu_check.jsonl) and `lines` (for the summary)."""
    print(line, flush=True)
    lines.append(line)
    if log is not None:
        log.write(line + "\n")
        log.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", nargs="?", choices=[*PARTS, "all"], default="all")
    parser.add_argument("--model", choices=list(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--small", action="store_true", default=os.environ.get("GPU_CHECK_SMALL") == "1",
                        help="CPU dry run: tiny shapes, fp32")
    parser.add_argument("--only", default="", help="comma-separated plan parts to run (in the plan's order); "
                        "without sweep the parts run the committed matmul table")
    args = parser.parse_args(argv)
    only = [label for label in args.only.split(",") if label]
    unknown = sorted(set(only) - set(PART_LIMITS_S))
    if unknown:
        parser.error(f"--only: no such part {', '.join(unknown)}; the plan's parts: {', '.join(PART_LIMITS_S)}")
    if args.part != "all":
        if args.part not in WITHOUT_TABLE:
            apply_swept_table()
        return 0 if PARTS[args.part](args) is not False else 1
    out_dir = os.environ.get("OUT")
    log = open(Path(out_dir) / "gpu_check.jsonl", "w", encoding="utf-8") if out_dir else None
    limits = SMALL_LIMITS_S if args.small else PART_LIMITS_S
    total = TOTAL_LIMIT_S * (3 if args.small else 1)
    deadline = time.perf_counter() + total
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    table = Path(out_dir or tempfile.mkdtemp(prefix="gpu_check_")) / "matmul_table.json"  # the sweep's proposal
    table.unlink(missing_ok=True)
    env[SWEPT_TABLE_ENV] = str(table)
    small = ["--small"] if args.small else []
    ok, lines = True, []
    for label in [label for label in limits if not only or label in only]:
        left = deadline - time.perf_counter()
        if left < 20:
            write(json.dumps({"part": "end", "name": label, "skipped": "no time left"}), log, lines)
            ok = False
            continue
        part_env_vars = {**env, "TRITON_INTERPRET": "1"} if args.small and label in INTERPRETED else env
        extra = {} if label in WITHOUT_TABLE else {"swept_table_entries": len(read_table(table))}
        status = run_part(part_argv(label) + small, label, min(limits[label], left), part_env_vars, log, lines,
                          extra)
        ok &= status["rc"] == 0
    write(json.dumps({"part": "summary", "ok": ok, "small": args.small,
                      "seconds": round(total - (deadline - time.perf_counter()), 1)}), log, lines)
    if log is not None:
        log.close()
        summary = Path(out_dir) / "gpu_check_summary.md"
        summary.write_text(write_summary([json.loads(ln) for ln in lines]), encoding="utf-8")
        print(f"Markdown summary: {summary}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
