"""`--verify-reuse FRACTION`: re-score a seeded sample of the records (a hash of `--seed` and each record's position)
by full recompute, in the same run and engine, and compare every result array bit for bit with exact reuse's."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from apcscore.engine.interface import BatchEngine
from apcscore.engine.step import Request, RequestOutput
from apcscore.io.reader import listed_problems

# RequestOutput arrays compared, by the name a mismatch reports
_PROMPT = ("token_ids", "token_logprobs", "ranks", "top_ids", "top_logprobs", "positions")
_OUTPUT = ("token_ids", "token_logprobs", "ranks", "top_ids", "top_logprobs")  # also of last-token alternatives


def in_sample(seed: int, index: int, fraction: float) -> bool:
    """Whether the record at dataset position `index` is re-scored (uniform in [0, 1) below `fraction`)."""
    digest = hashlib.sha256(f"verify-reuse:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < fraction


def result_arrays(out: RequestOutput) -> dict[str, np.ndarray]:
    """Every result array of one output, by column name (prompt_*, alternatives_* for last-token alternatives,
    completion_*), plus its error text."""
    arrays: dict[str, np.ndarray] = {"error": np.array([out.error or ""])}
    if out.prompt_logprobs is not None:
        arrays.update({f"prompt_{k}": getattr(out.prompt_logprobs, k) for k in _PROMPT})
    if out.last_token_alternatives is not None:
        arrays.update({f"alternatives_{k}": getattr(out.last_token_alternatives, k) for k in _OUTPUT})
    arrays["completion_token_ids"] = np.asarray(out.output_token_ids, dtype=np.int64)
    if out.output_logprobs is not None:
        arrays.update({f"completion_{k}": getattr(out.output_logprobs, k) for k in _OUTPUT if k != "token_ids"})
    return arrays


def differing_columns(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> list[str]:
    """Names whose arrays differ in shape, dtype or any bit (NaN equal to NaN only in the same bits)."""
    bad = []
    for name in sorted(a.keys() | b.keys()):
        x, y = a.get(name), b.get(name)
        if x is None or y is None or x.shape != y.shape or x.dtype != y.dtype or \
                np.ascontiguousarray(x).tobytes() != np.ascontiguousarray(y).tobytes():
            bad.append(name)
    return bad


@dataclass
class ReuseVerifier:
    """Collects the sampled records' requests and outputs during the run; `check` re-runs them by recompute."""

    fraction: float
    seed: int
    requests: dict[Any, Request] = field(default_factory=dict)  # request id -> a copy of the request
    record_ids: dict[Any, str] = field(default_factory=dict)  # request id -> record id
    outputs: dict[Any, RequestOutput] = field(default_factory=dict)

    def observe_request(self, index: int, record_id: str, request: Request) -> None:
        if in_sample(self.seed, index, self.fraction):
            self.requests[request.request_id] = replace(request, prompt_token_ids=list(request.prompt_token_ids))
            self.record_ids[request.request_id] = record_id

    def observe_output(self, out: RequestOutput) -> None:
        if out.request_id in self.requests:
            self.outputs[out.request_id] = out

    def check(self, engine: BatchEngine) -> dict:
        """Re-run the sampled requests with exact reuse off; the report for the metadata and the summary."""
        todo = [r for rid, r in self.requests.items() if rid in self.outputs]
        again = {o.request_id: o for o in engine.run_recomputed(todo)}
        mismatches = []
        for req in todo:
            rid = req.request_id
            cols = differing_columns(result_arrays(self.outputs[rid]), result_arrays(again[rid]))
            if cols:
                mismatches.append({"id": self.record_ids[rid], "request": rid[1] if isinstance(rid, tuple) else 0,
                                   "columns": cols})
        return {"fraction": self.fraction, "records": len({self.record_ids[r.request_id] for r in todo}),
                "requests": len(todo), "mismatches": mismatches}


def describe(report: dict) -> str:
    """One line per mismatch (at most 20), or the all-clear."""
    if not report["mismatches"]:
        return (f"{report['records']:,} records ({report['requests']:,} requests) re-scored by full recompute: "
                f"bitwise equal")
    return listed_problems([f"{m['id']} (request {m['request']}): {', '.join(m['columns'])}"
                            for m in report["mismatches"]], indent="")
