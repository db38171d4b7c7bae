"""The GPU check's JSON lines as Markdown, ready to paste into docs/benchmarks.md ($OUT/gpu_check_summary.md).

Every section reads only the lines its part printed, so a part that timed out or failed leaves its section
short (or says "no lines") instead of breaking the summary.
"""

from __future__ import annotations

from typing import Any


def _by(lines: list[dict[str, Any]], part: str) -> list[dict[str, Any]]:
    return [ln for ln in lines if ln.get("part") == part]


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.3g}"
    if isinstance(x, dict):
        return ", ".join(f"{k} {_fmt(v)}" for k, v in x.items())
    return str(x)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return out + ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]


def _env(lines) -> list[str]:
    env = next(iter(_by(lines, "env")), {})
    return [f"Machine: {env.get('device', 'CPU (dry run)')}, capability {env.get('capability', '-')}, "
            f"{env.get('memory_gib', '-')} GiB; Python {env.get('python')}, torch {env.get('torch')}, "
            f"transformers {env.get('transformers')}, triton {env.get('triton')}."]


def _parts(lines) -> list[str]:
    rows = [[e["name"], e.get("rc", "-"), e.get("timed_out", "-"), e.get("seconds", "-"), e.get("limit_s", "-"),
             e.get("swept_table_entries", "-"), e.get("skipped", "")] for e in _by(lines, "end")]
    return _table(["part", "rc", "timed out", "seconds", "limit s", "swept table entries", "skipped"], rows)


def _tests(lines) -> list[str]:
    t = next(iter(_by(lines, "tests")), None)
    if t is None:
        return ["no lines"]
    counts = {k: t[k] for k in ("passed", "failed", "skipped", "errors", "xfail", "xpass") if k in t}
    cut = " (stopped at the part's limit: the tests after these did not run)" if t.get("interrupted") else ""
    return [f"`pytest -m \"gpu or triton\"`: {_fmt(counts)} in {t.get('seconds')} s{cut}; failed: "
            f"{', '.join(t.get('failed_tests', [])) or 'none'}."]


def _exactness(lines) -> list[str]:
    rows = []
    for ln in _by(lines, "exactness"):
        diffs = next((v for k, v in ln.items() if k.startswith("differing")), {})
        extra = {k: ln[k] for k in ("hit_tokens", "score_store_hits", "preemptions", "groups", "ms_per_step_grouped",
                                    "ms_per_step_ungrouped") if k in ln}
        if isinstance(ln.get("speedup"), dict):  # silu_mul: fused vs torch's two kernels, by dtype
            extra["fused vs torch"] = ", ".join(f"{k} {_fmt(v)}x" for k, v in ln["speedup"].items())
        elif "speedup" in ln:  # shared_prefix_decode: grouped vs today's kernel
            extra["speedup"] = ln["speedup"]
        rows.append([ln["check"], _fmt(diffs), _fmt(extra), "**yes**" if ln.get("ok") else "**NO**"])
    header = ["check", "values differing (0 = bitwise)", "reuse / preemption / groups / speed-up", "bitwise"]
    return _table(header, rows) if rows else ["no lines"]


def _tax(lines) -> list[str]:
    t = next(iter(_by(lines, "tax")), None)
    if t is None:
        return ["no lines"]
    return _table(["task", "invariant (Triton matmul)", "--no-batch-invariant (cuBLAS)", "time ratio"], [
        ["score", f"{t['score_s_invariant']} s ({t['score_tokens_per_s_invariant']} tok/s, MFU "
                  f"{_fmt(t['score_mfu_invariant'])})",
         f"{t['score_s_library']} s ({t['score_tokens_per_s_library']} tok/s, MFU {_fmt(t['score_mfu_library'])})",
         f"**{t['score_ratio']}x**"],
        ["generate", f"{t['generate_s_invariant']} s ({t['generate_tokens_per_s_invariant']} new tok/s)",
         f"{t['generate_s_library']} s ({t['generate_tokens_per_s_library']} new tok/s)",
         f"**{t['generate_ratio']}x**"]])


def _bench(lines) -> list[str]:
    rows = []
    for ln in _by(lines, "bench"):
        if ln.get("side"):
            rate = ln.get("tokens_per_s") or ln.get("generated_tokens_per_s")
            mfu = f", MFU {_fmt(ln['mfu'])}" if "mfu" in ln else ""
            rows.append([ln["model"], ln["task"], ln["side"], f"{ln['seconds']} s ({rate} tok/s{mfu})"])
        elif "speedup_vs_transformers" in ln:
            rows.append([ln["model"], ln["task"], "speedup", f"**{ln['speedup_vs_transformers']}x**"])
    return _table(["model", "task", "side", "result"], rows) if rows else ["no lines"]


def _sweep(lines) -> list[str]:
    rows, table = [], None
    for ln in _by(lines, "sweep"):
        if "proposed_table" in ln:
            table = ln["proposed_table"]
        elif ln.get("proposed"):
            rows.append([f"{ln['model']} {ln['gemm']}", f"{ln['n']} x {ln['k']}", ln["proposed"],
                         _fmt(ln["proposed_over_cublas"]), _fmt(ln["default_over_proposed"])])
        else:
            rows.append([f"{ln['model']} {ln['gemm']}", f"{ln['n']} x {ln['k']}", "none invariant and right", "-", "-"])
    out = _table(["GEMM", "N x K", "proposed", "time / cuBLAS at M", "default / proposed at M"], rows) if rows \
        else ["no lines"]
    if table is not None:
        out += ["", "Proposed rows for `apcscore/kernels/matmul_configs.py`:", "", "```python", table, "```"]
    return out


def _eval(lines) -> list[str]:
    rows = []
    for ln in _by(lines, "eval"):
        secs = ln["seconds"]
        rows.append([ln["task"], ln.get("tokens"), _fmt(secs), _fmt(ln["time_vs_hf"]), _fmt(ln["vs_hf"]),
                     ln.get("exact_reuse_bitwise_recompute", "-")])
    return _table(["task", "tokens", "seconds", "time / hf", "agreement with hf (bf16)",
                   "--exact-reuse bitwise recompute"], rows) if rows else ["no lines"]


def _scale(lines, part: str) -> list[str]:
    rows = []
    for ln in _by(lines, part):
        what = ln.get("task") or f"{ln['prompts']} x {ln['tokens_each']} tokens, K={ln['k']}"
        rate = ln.get("tokens_per_s") or ln.get("generated_tokens_per_s")
        mfu = f", MFU {_fmt(ln['mfu'])}" if "mfu" in ln else ""
        rows.append([ln["model"], what, f"{ln['seconds']} s", f"{rate} tok/s{mfu}", ln.get("peak_memory_gib"),
                     ln.get("ok", "-")])
    return _table(["model", "work", "time", "throughput", "peak GiB", "ok"], rows) if rows else ["no lines"]


def _profile(lines) -> list[str]:
    rows = []
    for ln in _by(lines, "profile"):
        groups = {g: f"{s / ln['kernel_s']:.0%}" for g, s in ln["groups_s"].items()} if ln["kernel_s"] else {}
        top = "; ".join(f"{name} ({calls}x, {_fmt(secs)} s)" for name, calls, secs in ln["top"][:3])
        rows.append([ln["task"], ln["side"], f"{ln['wall_s']} s", f"{ln['kernel_s']} s", ln["gpu_busy"],
                     ", ".join(f"{g} {share}" for g, share in groups.items()), top])
    return _table(["task", "side", "wall", "kernels", "GPU busy", "kernel time by group", "top 3 kernels"], rows) \
        if rows else ["no lines"]


def write_summary(lines: list[dict[str, Any]]) -> str:
    """Markdown for docs/benchmarks.md from the check's JSON lines (in the order they were printed)."""
    summary = next(iter(_by(lines, "summary")), {})
    sections = [("GPU check summary", _env(lines) + [f"Overall ok: {summary.get('ok')}, "
                                                     f"{summary.get('seconds')} s, small: {summary.get('small')}."]),
                ("Parts", _parts(lines)), ("Tests on CUDA", _tests(lines)),
                ("Exactness end to end (Llama-3.2-1B shape)", _exactness(lines)),
                ("Invariance tax (Llama-3.2-1B shape)", _tax(lines)), ("apcscore vs transformers", _bench(lines)),
                ("Matmul configurations per (N, K)", _sweep(lines)), ("Eval-shaped work", _eval(lines)),
                ("Llama-3.1-8B shape", _scale(lines, "8b")),
                ("A reference model in the run (two Llama-3.1-8B shapes)", _scale(lines, "reference")),
                ("Long prompts (Llama-3.2-1B shape)", _scale(lines, "long")),
                ("Where the time goes (Llama-3.2-1B shape, torch.profiler)", _profile(lines))]
    out: list[str] = []
    for title, body in sections:
        out += [f"### {title}", "", *body, ""]
    return "\n".join(out)
