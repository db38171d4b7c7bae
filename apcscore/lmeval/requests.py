"""The outputs of `apcscore eval`: lm-eval's results JSON, and `requests.parquet`, one row per lm-eval request
(task, doc_id, filter, request_index, request_type and JSON arguments, response, filtered_response, target,
metrics) with our run metadata under the schema key `apcscore`; with --log-samples, `samples_<task>.jsonl`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from apcscore.io.result_tables import METADATA_KEY, dumps_metadata, records_to_table, write_atomic

SCHEMA = pa.schema([
    pa.field("task", pa.string()),
    pa.field("doc_id", pa.int64()),
    pa.field("filter", pa.string()),
    pa.field("request_index", pa.int64()),
    pa.field("request_type", pa.string()),
    pa.field("arguments", pa.string()),
    pa.field("response", pa.string()),
    pa.field("filtered_response", pa.string()),
    pa.field("target", pa.string()),
    pa.field("metrics", pa.string()),
])


def _json(value: Any, indent: int | None = None) -> str:
    """JSON of lm-eval's values (numpy values and other objects as lm-eval's own writer shows them)."""
    from lm_eval.utils import handle_non_serializable

    return json.dumps(value, indent=indent, default=handle_non_serializable, ensure_ascii=False)


def _plain(value: Any) -> Any:
    """numpy scalars as Python numbers (lm-eval's per-sample metrics are often numpy)."""
    item = getattr(value, "item", None)
    return item() if callable(item) and getattr(value, "shape", None) == () else value


def request_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per request of lm-eval's logged samples, tasks in results order, docs in doc_id order."""
    rows = []
    configs = results.get("configs", {})
    for task, samples in results.get("samples", {}).items():
        output_type = configs.get(task, {}).get("output_type")
        for sample in sorted(samples, key=lambda s: (s["doc_id"], s.get("filter", ""))):
            metrics = {name: _plain(sample.get(name)) for name in sample.get("metrics", [])}
            filtered = sample.get("filtered_resps", [])
            for i, (args, resp) in enumerate(zip(sample["arguments"], sample["resps"])):
                rows.append({
                    "task": task, "doc_id": int(sample["doc_id"]), "filter": sample.get("filter"),
                    "request_index": i, "request_type": output_type, "arguments": _json(list(args)),
                    "response": _json(resp), "filtered_response": _json(filtered[i] if i < len(filtered) else None),
                    "target": _json(sample.get("target")), "metrics": _json(metrics),
                })
    return rows


def sample_line(sample: dict[str, Any]) -> str:
    """One line of lm-eval's samples file as its EvaluationTracker writes it (arguments as {"gen_args_I": {"arg_J":
    ...}}, resps, filtered_resps and target as strings); `sample` itself is not changed."""
    from lm_eval.utils import sanitize_list

    line = dict(sample)
    line["resps"] = sanitize_list(sample["resps"])
    line["filtered_resps"] = sanitize_list(sample["filtered_resps"])
    line["arguments"] = {f"gen_args_{i}": {f"arg_{j}": a for j, a in enumerate(args)}
                         for i, args in enumerate(sample["arguments"])}
    line["target"] = str(sample["target"])
    return _json(line) + "\n"


def write_samples(out: Path, results: dict[str, Any]) -> list[Path]:
    """`<out>/samples_<task>.jsonl` for each task of the results' `configs`, each atomically, after removing an
    earlier run's; the files written."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("samples_*.jsonl"):
        old.unlink()
    written = []
    samples = results.get("samples", {})
    for task in results.get("configs", {}):
        if task in samples:
            path = out / f"samples_{task}.jsonl"
            write_atomic(path, "".join(sample_line(s) for s in samples[task]).encode())
            written.append(path)
    return written


def write_outputs(out: Path, results: dict[str, Any], meta: dict[str, Any]) -> None:
    """Write `<out>/results.json` (lm-eval's results without samples, plus `apcscore`: meta) and
    `<out>/requests.parquet` (rows of `request_rows`, metadata under key `apcscore`), each atomically."""
    out.mkdir(parents=True, exist_ok=True)
    summary = {k: v for k, v in results.items() if k != "samples"}
    summary["apcscore"] = meta
    write_atomic(out / "results.json", _json(summary, indent=2).encode())
    table = records_to_table(request_rows(results), SCHEMA)
    table = table.replace_schema_metadata({METADATA_KEY: dumps_metadata(meta).encode()})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    write_atomic(out / "requests.parquet", sink.getvalue().to_pybytes())
