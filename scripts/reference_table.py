"""The table of docs/compare.md, "Exact KL": on the default model, the top-K lower bound at K = 5 and 20 against the
exact KL of `score --reference-model`, for a few candidates built as scripts/compare_evidence.py builds them.

    .venv/bin/python scripts/reference_table.py                        # sample prompts; prints a Markdown table
    .venv/bin/python scripts/reference_table.py --update-docs          # also fill docs/compare.md

The baseline (the default model alone) and each candidate (with `--reference-model smollm2-135m`) are scored once
at K = 20; the bound at K = 5 reads the same files with their top-K lists cut to 5 (the first 5 of a top-20 are
what K = 5 scores), the bound at K = 20 the files without their exact columns.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from apcscore.compare.gate import compare_files  # noqa: E402
from apcscore.compare.thresholds import Thresholds  # noqa: E402

CANDIDATES = ["bf16_weights", "int8", "noise_1pct", "noise_2pct", "int4_g32", "int4"]
EXACT = ("ref_token_logprobs", "token_kl", "token_delta_p", "token_top1_agree", "mean_kl")


def evidence():
    spec = importlib.util.spec_from_file_location("compare_evidence", ROOT / "scripts" / "compare_evidence.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bound_copy(src: Path, dest: Path, k: int) -> Path:
    """src without the exact columns, its top-K lists cut to k."""
    t = pq.read_table(src)
    t = t.drop_columns([c for c in EXACT if c in t.column_names])
    for name in ("top_ids", "top_logprobs"):
        outer = t[name].combine_chunks()  # [records] of [positions] of [K]: cut the innermost lists
        inner = pc.list_slice(outer.flatten(), 0, k)
        t = t.set_column(t.column_names.index(name), name,
                         pa.ListArray.from_arrays(outer.offsets, inner, mask=outer.is_null()))
    pq.write_table(t, dest)
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=ROOT / "datasets" / "sample_prompts.jsonl")
    ap.add_argument("--work", type=Path)
    ap.add_argument("--update-docs", action="store_true")
    args = ap.parse_args()
    ev = evidence()
    work = args.work or Path(tempfile.mkdtemp(prefix="apcscore-reference-table-"))
    work.mkdir(parents=True, exist_ok=True)
    base_model = ev.resolve_model("smollm2-135m")[0]
    base = work / "base.parquet"
    if not base.exists():
        ev.score(base_model, args.data, base, 20, [], {})
    rows, excess = [], []  # excess: bound - exact at each position (the bound reads float32 logprobs)
    for name in CANDIDATES:
        model = work / f"model-{name}"
        if not model.exists():
            ev.write_folder(base_model, model, ev.CANDIDATES[name][2])
        out = work / f"{name}.parquet"
        if not out.exists():
            ev.score(model, args.data, out, 20, ["--reference-model", "smollm2-135m"], {})
        exact = compare_files(base, out, Thresholds())
        assert exact.kl_label.startswith("exact"), exact.kl_label
        bounded = {k: compare_files(bound_copy(base, work / f"base-k{k}.parquet", k),
                                    bound_copy(out, work / f"{name}-k{k}.parquet", k), Thresholds()) for k in (5, 20)}
        bounds = {k: c.metrics.kld for k, c in bounded.items()}
        excess += [c.aligned.positions.kld - exact.aligned.positions.kld for c in bounded.values()]
        e = exact.metrics.kld
        rows.append(f"| {name} | {ev.CANDIDATES[name][1]} | {bounds[5].mean:.3g} ({bounds[5].mean / e.mean:.0%}) | "
                    f"{bounds[20].mean:.3g} ({bounds[20].mean / e.mean:.0%}) | {e.mean:.3g} | "
                    f"{bounds[20].percentiles['99']:.3g} | {e.percentiles['99']:.3g} | "
                    f"{exact.metrics.top1_agreement:.4f} |")
        print(rows[-1], file=sys.stderr)
    table = "\n".join(["| candidate | change | mean KL bound, K = 5 (share of exact) | bound, K = 20 | exact mean KL "
                       "| p99 bound, K = 20 | p99 exact | same top p |", "| --- | --- | --- | --- | --- | --- | --- "
                       "| --- |", *rows])
    n = exact.metrics.num_positions
    over = np.concatenate(excess)
    table += (f"\n\n{n} positions, vocabulary 49152. The bound exceeded the exact KL at {int((over > 0).sum())} of "
              f"{len(over)} (position, candidate, K) cases, by at most {over.max():.1e} nats: the float32 logprobs "
              "the files store.")
    print(table)
    if args.update_docs:
        doc = ROOT / "docs" / "compare.md"
        text = doc.read_text()
        text = re.sub(r"(<!-- reference_table:begin -->\n).*?(<!-- reference_table:end -->)",
                      lambda m: m.group(1) + table + "\n" + m.group(2), text, flags=re.S)
        doc.write_text(text)


if __name__ == "__main__":
    main()
