"""The engine's start-up probe (apcscore.engine.gemm_probe): it passes for the CPU's fixed-order GEMM at the
model's real shapes, and a linear layer whose reduction order changes with the row count (as a BLAS library's
may) is caught: one warning, `numerics.batch_invariant` false with the reason in the metadata, --exact-reuse
and --verify-reuse refused, and shards of such a run refused by merge.
"""

from __future__ import annotations

import json
import warnings

import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from apcscore import EngineConfig
from apcscore.engine.loader import native_engine_from_parts
from apcscore.cli import app
from apcscore.engine.gemm_probe import probe_linear, probe_model
from apcscore.errors import ApcscoreError
from apcscore.kernels._checks import interpreting
from apcscore.kernels.cpu_gemm import FixedOrderLinear
from apcscore.models import ops as ops_module
from apcscore.models.loaded import load_parts
from apcscore.models.loading import load_state_dict
from apcscore.models.locate import resolve_model


class SplitKAboveRows:
    """A row-count-dependent linear: above `rows` rows it sums two parts of K (a split-K kernel), below it runs
    the fixed order. Exactly the kind of choice a BLAS makes by M. The split is one past the middle: split at a
    multiple of 64, two calls of the fixed-order GEMM would add the same block sums in the same order, which is
    its own order (the blocks of 64 k: kernels/cpu_gemm.c), so no bit could differ."""

    construction = "split-K above a row count (the test's linear)"  # what a linear tells the run metadata

    def __init__(self, rows: int = 64) -> None:
        self.rows, self.inner = rows, FixedOrderLinear()

    def __call__(self, x, weight, bias=None, out=None):
        if x.shape[0] <= self.rows:
            y = self.inner(x, weight)
        else:
            h = x.shape[1] // 2 + 1
            y = self.inner(x[:, :h], weight[:, :h]) + self.inner(x[:, h:], weight[:, h:])
        if out is not None:
            out[:y.shape[0]].copy_(y)
            y = out[:y.shape[0]]
        return y if bias is None else y + bias


@pytest.fixture
def row_dependent_linear(monkeypatch):
    """Every CPU engine built in the test gets the split-K linear instead of the fixed-order one."""
    real = ops_module.select_linear
    monkeypatch.setattr(ops_module, "select_linear",
                        lambda device, invariant: SplitKAboveRows() if invariant else real(device, invariant))


def test_probe_passes_the_fixed_order_gemm_at_real_shapes() -> None:
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) for k, n in ((576, 960), (1536, 576), (576, 49152))]
    result = probe_linear(FixedOrderLinear(), weights, budget=2048)
    assert result["passed"] and result["reason"] is None
    assert [s[:2] for s in result["shapes"]] == [[576, 960], [1536, 576], [576, 49152]]
    assert all(16 <= s[2] <= s[1] and s[2] % 16 == 0 for s in result["shapes"])  # N cut to the time budget, never K
    assert result["row_counts"] == [1, 15, 16, 57, 64, 100, 191, 2048]


@pytest.mark.parametrize("rows", [1, 15, 57, 191])
def test_probe_catches_a_row_count_dependent_linear(rows: int) -> None:
    weight = torch.randn(96, 128, generator=torch.Generator().manual_seed(1))
    result = probe_linear(SplitKAboveRows(rows), [weight], budget=512)
    assert not result["passed"] and "[128 -> 96]" in result["reason"]


def _tiny_parts(tiny_model_dir):
    path = tiny_model_dir("llama")
    parts = load_parts(str(path), *resolve_model(str(path)))
    return parts, load_state_dict(path, dtype=torch.float32, device="cpu")


def test_engine_reports_and_refuses_on_failure(tiny_model_dir, row_dependent_linear) -> None:
    parts, state = _tiny_parts(tiny_model_dir)
    with pytest.warns(UserWarning, match="start-up probe found this machine's linear layer not batch-invariant"):
        engine = native_engine_from_parts(parts.config, state, parts.tokenizer, EngineConfig(device="cpu"))
    assert engine.batch_invariant is False
    assert engine.numerics["batch_invariant"] is False and engine.numerics["probe"]["passed"] is False
    assert "rows give other bits" in engine.numerics["reason"] or "-row call" in engine.numerics["reason"]
    with pytest.raises(ApcscoreError, match="--exact-reuse needs batch invariance"):
        native_engine_from_parts(parts.config, state, parts.tokenizer, EngineConfig(device="cpu", exact_reuse=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # --no-batch-invariant asks for nothing, so nothing is probed or warned
        plain = native_engine_from_parts(parts.config, state, parts.tokenizer,
                                         EngineConfig(device="cpu", batch_invariant=False))
    assert plain.numerics["probe"] is None and plain.numerics["reason"].startswith("turned off")


def test_engine_records_a_passing_probe(tiny_model_dir) -> None:
    parts, state = _tiny_parts(tiny_model_dir)
    engine = native_engine_from_parts(parts.config, state, parts.tokenizer, EngineConfig(device="cpu"))
    n = engine.numerics
    assert engine.batch_invariant and n["batch_invariant"] and n["reason"] is None and n["probe"]["passed"]
    assert n["linear"].startswith("apcscore fixed-order GEMM, order 2064")
    assert n["hardware"]["cpu"]["vendor"] and n["blas"]["library"]
    assert {s[0] for s in n["probe"]["shapes"]} == {parts.config.hidden_size, parts.config.intermediate_size}


def _score(tmp_path, data, model, name, *flags):
    out = tmp_path / f"{name}.parquet"
    res = CliRunner().invoke(app, ["score", str(data), "--model", str(model), "--out", str(out),
                                   "--prompt-logprobs", "2", *flags])
    return res, out


@pytest.mark.slow
def test_cli_warns_records_and_refuses(tmp_path, write_jsonl, tiny_model_dir, row_dependent_linear) -> None:
    model = tiny_model_dir("llama")
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "The quick brown fox. " * n} for n in (1, 4, 9, 2)])
    res, out = _score(tmp_path, data, model, "run")
    assert res.exit_code == 0, res.output
    assert "warning:" in res.output and "not batch-invariant" in res.output
    numerics = json.loads(pq.read_schema(out).metadata[b"apcscore"])["numerics"]
    assert numerics["batch_invariant"] is False and "start-up probe" in numerics["reason"]

    res, verify_out = _score(tmp_path, data, model, "verify", "--exact-reuse", "--verify-reuse", "0.5")
    assert res.exit_code == 2 and "needs batch invariance" in res.output and "drop --exact-reuse" in res.output
    assert not verify_out.exists() and not verify_out.with_name(verify_out.name + ".partial").exists()

    parts = []
    for i in range(2):
        res, part = _score(tmp_path, data, model, f"s{i}", "--quiet", "--shard", f"{i}/2")
        assert res.exit_code == 0, res.output
        parts.append(str(part))
    res = CliRunner().invoke(app, ["merge", str(tmp_path / "merged.parquet"), *parts])
    assert res.exit_code == 2 and "batch invariance does not hold" in res.output
    assert not (tmp_path / "merged.parquet").exists()


@pytest.mark.slow
@pytest.mark.triton
@pytest.mark.skipif(not interpreting(), reason="the Triton matmul on the CPU needs TRITON_INTERPRET=1")
def test_the_head_is_probed_as_compute_logits_multiplies_it_in_bf16(tiny_model_dir, monkeypatch) -> None:
    """The LM head is probed through `model.logits_product()`, the product compute_logits runs: on CUDA the
    Triton matmul reading bf16 rows and writing fp32 logits. Probing it with fp32 rows (as the probe once did)
    made every bf16 engine on CUDA fail at start-up ("x is torch.float32 but weight is torch.bfloat16").
    Here the CUDA product runs under the interpreter in its place."""
    from apcscore.kernels.matmul import invariant_linear

    parts, state = _tiny_parts(tiny_model_dir)
    model = native_engine_from_parts(parts.config, state, parts.tokenizer,
                                     EngineConfig(device="cpu", dtype="bfloat16")).model
    head = model.lm_head_weight  # [V, H] bf16
    calls = []

    def cuda_product(x, weight, out=None):  # what logits_product returns on CUDA
        calls.append((x.dtype, weight.dtype))
        return invariant_linear(x, weight, out=out, out_dtype=torch.float32)

    monkeypatch.setattr(model, "logits_product", lambda: (cuda_product, head, torch.bfloat16))
    result = probe_model(model, model.ops.linear, budget=64)
    assert result["passed"], result["reason"]
    assert result["shapes"][-1][:2] == [parts.config.hidden_size, parts.config.vocab_size]
    assert set(calls) == {(torch.bfloat16, torch.bfloat16)}
    hidden = torch.randn(5, parts.config.hidden_size).to(torch.bfloat16)
    logits = model.compute_logits(hidden)  # [5, V]
    assert logits.dtype == torch.float32 and torch.equal(logits, cuda_product(hidden, head))


@pytest.mark.triton
@pytest.mark.skipif(not interpreting(), reason="the Triton matmul on the CPU needs TRITON_INTERPRET=1")
def test_a_weight_cut_to_the_time_budget_is_probed_with_its_whole_shapes_configuration(monkeypatch,
                                                                                     matmul_launches) -> None:
    """The probe multiplies only a weight's first output rows when the whole would exceed its time budget; the
    Triton matmul picks its configuration by the weight's shape, so the probe must run the configuration of
    the whole [N, K] (what the engine runs), not the one a slice's shape would get (DEFAULT)."""
    from apcscore.engine import gemm_probe
    from apcscore.kernels import matmul_configs
    from apcscore.kernels.matmul import invariant_linear

    monkeypatch.setattr(gemm_probe, "MAC_BUDGET", 1e5)  # cuts N to 16 columns
    weight = torch.randn(256, 32, generator=torch.Generator().manual_seed(3))  # [N, K]
    entry = matmul_configs.MatmulConfig(block_m=32, block_n=16, block_k=32, group_m=1, num_warps=4, num_stages=2)
    monkeypatch.setitem(matmul_configs.TABLE, ("cpu", "float32", 256, 32), entry)
    result = gemm_probe.probe_linear(invariant_linear, [weight], budget=64)
    assert result["passed"] and result["shapes"] == [[32, 256, 16]]
    assert matmul_launches and set(matmul_launches) == {entry}
