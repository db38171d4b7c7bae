"""Where the compute of one side of benchmarks/bench_lmeval.py goes: per step kind, GEMMs, LM head, attention.

Runs the same command line bench_lmeval.py builds (its `commands()`), in this process, with wall-clock timers
around a few functions (no profiler: cProfile's per-call cost would inflate the many small torch ops).
Steps (apcscore: a ModelRunner.execute; hf: a LlamaForCausalLM.forward) are "prefill" when any sequence runs
more than one position, else "decode"; each timer is charged to the current step's kind.

- `--side apcscore`: the whole step, the fixed-order GEMMs (FixedOrderLinear.__call__) of the layers and of
  the LM head (compute_logits) with their multiply-adds, and the attention paths of the torch backend
  (attend_prefill per chunk, attend_prefill_batched, attend_decode, store_kv).
- `--side hf`: the whole forward, nn.Linear of the layers and of the LM head (out_features > 10,000) with their
  multiply-adds (padding positions included: hf computes them), and scaled_dot_product_attention.

GFLOPS = 2 x multiply-adds / seconds. The timers add a few microseconds per call; compare shares, and wall
times only of runs on a quiet machine.

    python benchmarks/lmeval_split.py --side apcscore --json OUT.json -- --model DIR --tasks lambada_openai ...
    python benchmarks/lmeval_split.py --side hf --json OUT.json -- --model hf --model_args ... --tasks ...
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

ACC: dict[str, float] = collections.defaultdict(float)
COUNT: dict[str, int] = collections.defaultdict(int)
STATE = {"kind": "other", "head": False}


def charge(name: str, start: float, macs: int = 0) -> None:
    """Add the time since `start` (and `macs`) to `name` of the current step kind."""
    key = f"{STATE['kind']}:{name}"
    ACC[key] += time.perf_counter() - start
    COUNT[key] += 1
    if macs:
        ACC[key + "_macs"] += macs


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrap(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            charge(name, start)
    return wrap


def step(fn: Callable[..., Any], kind_of: Callable[..., str], positions_of: Callable[..., int]) -> Callable[..., Any]:
    """fn (a step) with its kind set while it runs and its time and positions charged."""
    def wrap(self: Any, *args: Any, **kwargs: Any) -> Any:
        STATE["kind"] = kind_of(*args, **kwargs)
        ACC[STATE["kind"] + ":positions"] += positions_of(*args, **kwargs)
        start = time.perf_counter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            charge("step", start)
            STATE["kind"] = "other"
    return wrap


def patch_apcscore() -> Callable[[], None]:
    import apcscore.attention.torch_backend as backend
    import apcscore.engine.model_runner as runner
    import apcscore.kernels.cpu_gemm as cpu_gemm
    import apcscore.models.llama as llama
    from apcscore.cli import main

    gemm = cpu_gemm.FixedOrderLinear.__call__

    def linear(self: Any, x: Any, weight: Any, bias: Any = None, out: Any = None) -> Any:
        start = time.perf_counter()
        try:
            return gemm(self, x, weight, bias, out)
        finally:
            charge("gemm_head" if STATE["head"] else "gemm_layers", start, x.shape[0] * x.shape[1] * weight.shape[0])
    cpu_gemm.FixedOrderLinear.__call__ = linear

    logits = llama.LlamaDecoder.compute_logits

    def compute_logits(self: Any, hidden: Any, out: Any = None) -> Any:
        STATE["head"] = True
        try:
            return logits(self, hidden, out)
        finally:
            STATE["head"] = False
    llama.LlamaDecoder.compute_logits = compute_logits
    for name in ("attend_decode", "attend_prefill", "attend_prefill_batched", "store_kv"):
        setattr(backend, name, timed(name, getattr(backend, name)))
    runner.ModelRunner.execute = step(
        runner.ModelRunner.execute, lambda batch: "prefill" if max(n for _, n in batch) > 1 else "decode",
        lambda batch: sum(n for _, n in batch))
    return lambda: main()


def patch_hf() -> Callable[[], None]:
    import torch
    from lm_eval.__main__ import cli_evaluate
    from transformers.models.llama import modeling_llama

    forward = torch.nn.Linear.forward

    def linear(self: Any, x: Any) -> Any:
        start = time.perf_counter()
        try:
            return forward(self, x)
        finally:
            charge("linear_head" if self.out_features > 10_000 else "linear_layers", start,
                   x.numel() // x.shape[-1] * self.in_features * self.out_features)
    torch.nn.Linear.forward = linear
    torch.nn.functional.scaled_dot_product_attention = timed("sdpa", torch.nn.functional.scaled_dot_product_attention)
    ids = lambda input_ids=None, *a, **k: input_ids  # noqa: E731
    modeling_llama.LlamaForCausalLM.forward = step(
        modeling_llama.LlamaForCausalLM.forward,
        lambda *a, **k: "prefill" if ids(*a, **k) is not None and ids(*a, **k).shape[1] > 1 else "decode",
        lambda *a, **k: ids(*a, **k).numel() if ids(*a, **k) is not None else 0)
    return lambda: cli_evaluate()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=["apcscore", "hf"], required=True)
    parser.add_argument("--json", type=Path, required=True, help="write the timers here")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="-- then the side's own arguments")
    args = parser.parse_args()
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    run = patch_apcscore() if args.side == "apcscore" else patch_hf()
    sys.argv = ["apcscore", "eval", *rest] if args.side == "apcscore" else ["lm_eval", *rest]
    start = time.perf_counter()
    try:
        run()
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    result: dict[str, Any] = {}
    for key, value in sorted(ACC.items()):
        if key.endswith(("_macs", ":positions")):
            result[key] = int(value)
        else:
            result[key] = {"seconds": round(value, 3), "calls": COUNT[key]}
            macs = ACC.get(key + "_macs")
            if macs:
                result[key]["gflops"] = round(2 * macs / value / 1e9, 1)
    result["process_seconds"] = round(time.perf_counter() - start, 2)
    args.json.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1), file=sys.stderr)


if __name__ == "__main__":
    main()
