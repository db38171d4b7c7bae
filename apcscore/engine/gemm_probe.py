"""The start-up probe: does this machine's linear layer give a row the same bits whatever shares its call? Each row
of a call of M rows must equal, bit for bit, the same row inside the largest call, and at other row offsets. What it
probes and what a failure does: docs/decisions.md, "The batch-invariance contract" (**The start-up probe**).
"""

from __future__ import annotations

import functools
import time
import warnings
from typing import Any, Callable, Iterable

import torch

from apcscore.engine.numerics import describe_numerics
from apcscore.errors import ApcscoreError
from apcscore.models.ops import linear_construction, portable_construction

ROW_COUNTS = (1, 15, 16, 57, 64, 100, 191)
OFFSETS = (1, 7, 33)  # extra calls of OFFSET_ROWS rows starting at these rows of the reference
OFFSET_ROWS = 64
MAC_BUDGET = 2.5e8  # multiply-adds per weight shape (~5 ms on 2 idle CPU cores); above it N is cut to fit, never K


def probe_linear(linear: Callable[..., torch.Tensor], weights: Iterable[torch.Tensor], budget: int,
                 dtype: torch.dtype | None = None, seed: int = 0) -> dict[str, Any]:
    """Check `linear` (x [M, K], weight [N, K]) -> [M, N] for row-count and row-offset invariance; the run
    metadata's `numerics.probe`: passed, reason (what differed; None when it passed), shapes ([K, N, N probed] per
    distinct weight shape), row_counts, offsets and seconds.

    weights: the model's weight matrices (one per distinct shape is probed); dtype: of the probe inputs
    (default each weight's). Inputs are seeded normal values.
    """
    started = time.perf_counter()
    rows = sorted(set(ROW_COUNTS) | {budget})  # and the step's token budget
    result = {"passed": True, "reason": None, "shapes": [], "row_counts": rows, "offsets": list(OFFSETS)}
    seen: set[tuple] = set()
    generators: dict[torch.device, torch.Generator] = {}  # drawn where the weights are: no host copy
    for weight in weights:
        n, k = weight.shape
        key = (n, k, weight.dtype, weight.device)
        if key in seen:
            continue
        seen.add(key)
        m_ref = max(rows[-1], OFFSETS[-1] + OFFSET_ROWS)
        total_rows = sum(rows[:-1]) + m_ref + len(OFFSETS) * OFFSET_ROWS
        fit = max(16, int(MAC_BUDGET / (total_rows * k)) // 16 * 16)  # columns within the budget
        n_probe = n if total_rows * n * k <= MAC_BUDGET else min(n, fit)
        w = weight[:n_probe]
        run = for_whole_weight(linear, weight)
        result["shapes"].append([k, n, n_probe])
        if weight.device not in generators:
            generators[weight.device] = torch.Generator(device=weight.device).manual_seed(seed)
        x = torch.randn(m_ref, k, generator=generators[weight.device], device=weight.device)
        x = x.to(dtype or weight.dtype)  # [m_ref, K]
        ref = run(x, w)
        for m in rows[:-1]:
            if not torch.equal(run(x[:m], w), ref[:m]):
                return _failed(result, started, f"a {m}-row call gives other bits than the same rows of a "
                                                f"{m_ref}-row call ([{k} -> {n}] weight)")
        for off in OFFSETS:
            if not torch.equal(run(x[off:off + OFFSET_ROWS], w), ref[off:off + OFFSET_ROWS]):
                return _failed(result, started, f"rows give other bits when a call starts {off} rows later "
                                                f"([{k} -> {n}] weight)")
    result["seconds"] = round(time.perf_counter() - started, 4)
    return result


def for_whole_weight(linear: Callable[..., torch.Tensor], weight: torch.Tensor) -> Callable[..., torch.Tensor]:
    """`linear` as it multiplies the whole `weight`, for the probe's calls on its first output rows: a linear
    that picks its configuration by the weight's shape (the Triton matmul: its `config_for_weight`) would
    otherwise run another configuration on the slice (DEFAULT) than the one the engine runs."""
    base = linear.func if isinstance(linear, functools.partial) else linear
    config_for_weight = getattr(base, "config_for_weight", None)
    return functools.partial(linear, config=config_for_weight(weight)) if config_for_weight else linear


def _failed(result: dict[str, Any], started: float, reason: str) -> dict[str, Any]:
    result["passed"], result["reason"] = False, reason
    result["seconds"] = round(time.perf_counter() - started, 4)
    return result


def model_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weight matrices a model's linear layers multiply by: every `Linear`'s, and each expert's of a 3-D MoE
    parameter (stacked experts [E, N, K]); probe_model adds the LM head."""
    from apcscore.models.llama import Linear

    linears = [module.weight for module in model.modules() if isinstance(module, Linear)]
    experts = [param[0] for name, param in model.named_parameters() if param.dim() == 3 and name.endswith("_proj")]
    return linears + experts


def probe_model(model: Any, linear: Callable[..., torch.Tensor], budget: int) -> dict[str, Any]:
    """probe_linear over a decoder's weights, then the LM head as compute_logits multiplies it
    (`model.logits_product()`: on CUDA rows in the model dtype and fp32 logits, on the CPU fp32 rows)."""
    result = probe_linear(linear, model_weights(model), budget)
    if result["passed"]:
        head_linear, head, rows_dtype = model.logits_product()
        head_result = probe_linear(head_linear, [head], budget, dtype=rows_dtype, seed=1)
        head_result["shapes"] = result["shapes"] + head_result["shapes"]
        head_result["seconds"] = round(result["seconds"] + head_result["seconds"], 4)
        result = head_result
    return result


def probe_numerics(model: Any, ops: Any, config: Any, device: torch.device) -> dict:
    """Probe the linear construction on this machine (the start-up probe above) and return the run metadata's
    `numerics`. Where batch invariance was asked for but does not hold: one warning, and --exact-reuse refused."""
    probe, reason = None, None
    if ops.batch_invariant:
        probe = probe_model(model, ops.linear, config.max_batch_tokens)
        if not probe["passed"]:
            reason = (f"the start-up probe found this machine's linear layer not batch-invariant: {probe['reason']} "
                      f"({linear_construction(ops.linear)})")
            if config.exact_reuse:
                raise ApcscoreError(f"--exact-reuse needs batch invariance, and {reason}; drop --exact-reuse "
                                    "(and --verify-reuse, which checks it)")
            warnings.warn(f"{reason}: a record's scores may depend on what shares its steps, and the run "
                          "metadata says numerics.batch_invariant = false", stacklevel=3)
    else:
        reason = "turned off (--no-batch-invariant)"
    invariant = ops.batch_invariant and reason is None
    return describe_numerics(device, invariant, linear_construction(ops.linear), probe, reason,
                             portable=invariant and device.type == "cpu" and portable_construction(ops.linear))
