"""Golden bits: SHA-256 digests of the bit columns of apcscore's runs, to check that a machine computes the same bits.

    .venv/bin/python scripts/golden_digests.py                      # print this machine's digests (JSON)
    .venv/bin/python scripts/golden_digests.py --check FILE         # exit 1, naming the runs, where they differ
    .venv/bin/python scripts/golden_digests.py --write FILE         # (re)write FILE
    .venv/bin/python scripts/golden_digests.py --model DIR [--model DIR ...] --runs score,generate-sampled

The runs (on the embedded default model unless --model): score of datasets/sample_prompts.jsonl with K=5, the
multiple-choice set datasets/sample_choices.jsonl, perplexity of the first text of datasets/sample_texts.jsonl
(window 256, stride 128), greedy and seeded-sampled generation of the sample prompts (16 tokens, with the sampled
tokens' logprobs), each in float32 and bfloat16 (`generate-scored`, for other models: 8 sampled tokens with the
prompts' logprobs too, every path in one run), and `score-reference`: the default model's weights quantized to int8
(per channel, round to nearest: scripts/compare_evidence.py's int8 candidate, a deterministic construction)
scored with `--reference-model smollm2-135m`, the exact KL columns. A digest covers every column of the result file
but `id` and `status` (each value written exactly: floats as their hex form), so any differing bit changes it.

tests/golden_digests.json holds the digests committed with the code; tests/engine/test_portable_bits.py recomputes them
on the machine it runs on (CI lands on Intel and AMD CPUs at random) and under forced instruction sets. If a
change must move bits on purpose, rewrite the file in the same commit and say why (docs/architecture.md,
"Portable bits").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "datasets"
DTYPES = ("float32", "bfloat16")
# run name -> the command line after `apcscore` (DATA: the datasets folder); each also gets --dtype and --out
RUNS: dict[str, list[str]] = {
    "score": ["score", "{data}/sample_prompts.jsonl", "--prompt-logprobs", "5"],
    "choices": ["score", "{data}/sample_choices.jsonl", "--limit", "12"],
    "perplexity": ["perplexity", "{data}/sample_texts.jsonl", "--limit", "1", "--window", "256", "--stride", "128"],
    "generate-greedy": ["generate", "{data}/sample_prompts.jsonl", "--max-tokens", "16", "--logprobs", "3"],
    "generate-sampled": ["generate", "{data}/sample_prompts.jsonl", "--max-tokens", "16", "--temperature", "0.8",
                         "--top-p", "0.95", "--seed", "1234", "--logprobs", "3"],
    # one run through every path (scored prefill, decode, sampling), for the many small models of the tests; a
    # pool of 64 blocks, not one sized from free memory (a tiny model's KV block is a few KiB: a million blocks,
    # seconds to set up per load), holds the 8 prompts of <= 36 + 8 tokens (24 blocks of 16); its size moves no bit
    "generate-scored": ["generate", "{data}/sample_prompts.jsonl", "--max-tokens", "8", "--temperature", "0.8",
                        "--top-p", "0.95", "--seed", "1234", "--logprobs", "3", "--prompt-logprobs", "5",
                        "--num-kv-blocks", "64"],
    # the exact divergence of an int8 copy of the default model from it (INT8: that copy, made by int8_copy)
    "score-reference": ["score", "{data}/sample_prompts.jsonl", "--prompt-logprobs", "5", "--model", "{int8}",
                        "--reference-model", "smollm2-135m"],
}
GOLDEN_RUNS = ["score", "choices", "perplexity", "generate-greedy", "generate-sampled", "score-reference"]
NOT_BITS = {"id", "status"}


def canonical(value: Any) -> Any:
    """A JSON-able form of a result value in which every float is written exactly (its hex form)."""
    if isinstance(value, float):
        return value.hex() if math.isfinite(value) else repr(value)
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    if isinstance(value, dict):
        return {k: canonical(v) for k, v in sorted(value.items())}
    return value


def digest(path: Path) -> str:
    """SHA-256 of a result file's bit columns (all but NOT_BITS), row by row in file order."""
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    names = sorted(n for n in table.column_names if n not in NOT_BITS)
    h = hashlib.sha256()
    for row in table.select(names).to_pylist():
        h.update(json.dumps(canonical(row), sort_keys=True).encode())
        h.update(b"\n")
    return h.hexdigest()


def compute(models: list[str | None], runs: list[str], dtypes: list[str]) -> dict[str, str]:
    """{"RUN/DTYPE": digest} of each run, computed here (in-process CLI calls); with several models
    {"MODEL:RUN/DTYPE": ...} (MODEL: the folder's name)."""
    from typer.testing import CliRunner

    from apcscore.cli import app

    out: dict[str, str] = {}
    runner = CliRunner()
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            prefix = f"{Path(model).name}:" if len(models) > 1 else ""
            for name in runs:
                for dtype in dtypes:
                    result_file = Path(tmp) / f"{prefix}{name}-{dtype}.parquet"
                    int8 = int8_copy(Path(tmp)) if "{int8}" in RUNS[name] else ""
                    args = [a.format(data=DATA, int8=int8) for a in RUNS[name]]
                    args += ["--dtype", dtype, "--out", str(result_file), "--quiet"]
                    if model:
                        args += ["--model", model]
                    res = runner.invoke(app, args)
                    if res.exit_code != 0:
                        raise SystemExit(f"apcscore {' '.join(args)} failed ({res.exit_code}):\n{res.output}")
                    out[f"{prefix}{name}/{dtype}"] = digest(result_file)
    return out


def int8_copy(tmp: Path) -> Path:
    """The default model with its projections quantized to int8 per channel (compare_evidence's int8 candidate:
    amax, division, round half to even, product: the same bits on every machine), written once into tmp."""
    import importlib.util

    dest = tmp / "smollm2-135m-int8"
    if not dest.exists():
        spec = importlib.util.spec_from_file_location("compare_evidence", ROOT / "scripts" / "compare_evidence.py")
        evidence = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(evidence)
        evidence.write_folder(evidence.resolve_model("smollm2-135m")[0], dest, evidence._quantize(8, None))
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", type=Path, help="compare with this file's digests")
    parser.add_argument("--write", type=Path, help="write the digests to this file")
    parser.add_argument("--model", action="append", help="a model directory (default: the embedded default "
                        "model); repeat for several")
    parser.add_argument("--runs", default=",".join(GOLDEN_RUNS), help=f"comma-separated: {', '.join(RUNS)}")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    args = parser.parse_args(argv)
    runs, dtypes = args.runs.split(","), args.dtypes.split(",")
    digests = compute(args.model or [None], runs, dtypes)
    print(json.dumps(digests, indent=2, sort_keys=True))
    if args.write:
        args.write.write_text(json.dumps(digests, indent=2, sort_keys=True) + "\n")
    if args.check:
        want = json.loads(args.check.read_text())
        bad = [k for k in digests if want.get(k) != digests[k]]
        if bad:
            print(f"differ from {args.check}: {', '.join(bad)}", file=sys.stderr)
            return 1
        print(f"all {len(digests)} digests equal those of {args.check}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
