"""A run's identity: every metadata field that changes its bits (or which rows it holds), why, and who compares it.

One list, `FIELDS`, read by four named views, each a subset of it: `RESUME` (`--resume` of score, generate,
perplexity), `MERGE` (the shards of `apcscore merge`), `RAY` (every `--ray` replica against replica 0) and `EVAL`
(the eval responses' identity, lmeval/store.py). Measured facts decide, not requested flags (a field's `when`: the
start-up probe's verdict, a library GEMM, bits that are not portable), and the settings as resolved, not as typed.
An `engine` field is classified where EngineConfig declares it (config.py, `Identity`); a field of the `engine`,
`numerics` or `versions` section in neither `FIELDS` nor `NOT_BITS` is compared by every view: a new field is a
refusal until someone classifies it. The rules in full: docs/decisions.md, "A run's identity"; the table
tests/io/test_identity.py reads: docs/architecture.md, "A run's identity".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping

from apcscore.config import EngineConfig, Identity

RESUME, MERGE, RAY, EVAL = "resume", "merge", "ray", "eval"
VIEWS = (RESUME, MERGE, RAY, EVAL)
ALL = frozenset(VIEWS)
RUNS = frozenset({RESUME, MERGE, RAY})  # the views of a result file (score, generate, perplexity)
SECTIONS = ("engine", "numerics", "versions")  # their unclassified fields are compared (see the module doc)

Meta = Mapping[str, Any]


def invariant(meta: Meta) -> bool:
    """The start-up probe found the engine batch-invariant (a measured fact: False where it failed, with
    `--no-batch-invariant` and on the transformers fallback)."""
    return (meta.get("numerics") or {}).get("batch_invariant") is True


def library_gemm(meta: Meta) -> bool:
    """The GEMM's reduction order is a library's choice, so the CPU model and BLAS decide bits."""
    return not invariant(meta)


def machine_gemm(meta: Meta) -> bool:
    """The CPU model and BLAS may decide bits: a library GEMM ran (torch's, on rows padded to 16 or not: MKL's path
    differs between Intel and AMD even where this machine's probe passed), or the probe failed."""
    linear = (meta.get("numerics") or {}).get("linear")
    return library_gemm(meta) or (isinstance(linear, str) and linear.startswith("library GEMM"))


def not_portable(meta: Meta) -> bool:
    """The bits may follow the CPU's instruction set (numerics.portable is not true)."""
    return (meta.get("numerics") or {}).get("portable") is not True


def device_type(value: Any) -> Any:
    """cuda:0 and cuda:1 are one device type: the index changes no bit."""
    return value.split(":")[0] if isinstance(value, str) else value


def dataset_content(value: Any) -> Any:
    """A dataset by content, record count and --columns mapping, wherever its path points."""
    if not isinstance(value, dict):
        return value
    return {"sha256": value.get("sha256"), "num_records": value.get("num_records"),
            "columns": value.get("columns") or {}}


@dataclass(frozen=True)
class Field:
    """One field of the run metadata (a dotted path) that changes bits or rows: `views` compare it where `when`
    holds for the run (always when None), as `value` normalises it (as written when None)."""

    path: str
    why: str
    views: frozenset[str] = ALL
    when: Callable[[Meta], bool] | None = None
    value: Callable[[Any], Any] | None = None


def _engine_field(name: str, identity: Identity) -> Field:
    """The identity field of the EngineConfig setting `name`, as it declares itself (a compared one)."""
    return Field(f"engine.{name}", identity.why, RUNS if identity.result_files_only else ALL,
                 when=library_gemm if identity.unless_invariant else None)


# how each EngineConfig field declares itself (`config.setting`); one declared without is compared, as unclassified
_ENGINE = {f.name: f.metadata["identity"] for f in fields(EngineConfig) if "identity" in f.metadata}
_CODE_WHY = "the numerics fingerprint: a change to this code may change any bit (its hash, run/metadata.code)"

FIELDS: tuple[Field, ...] = (
    Field("apcscore_version", "another release may compute differently"),
    Field("code.kernels", _CODE_WHY + ": the Triton and C kernels and their Python wrappers"),
    Field("code.matmul_configs", _CODE_WHY + ": the Triton matmul's configuration per (N, K)"),
    Field("code.models", _CODE_WHY + ": the decoders, attention, logprobs and sampler"),
    Field("command", "score, generate and perplexity write other rows", RUNS),
    Field("job", "what each record asks (top-K, truncation, sampling defaults, windows)", RUNS),
    Field("dataset", "the records themselves (content, count, --columns), not where the file is",
          frozenset({RESUME, MERGE, RAY}), value=dataset_content),
    Field("shard", "which records this file holds (merge checks the split on its own)", frozenset({RESUME})),
    Field("model.fingerprint", "the weights (sha256 of the safetensors)"),
    Field("model.files", "config.json (rope, eps, soft-caps, window, eos), generation_config.json, the tokenizer "
          "files and the chat template (sha256 of each)"),
    Field("tokenizer.class", "which tokenizer transformers built (fast or slow split text differently)", RUNS),
    Field("dtype", "the dtype as resolved (auto: float32 on the CPU)"),
    Field("device", "the device type as resolved (cuda:0 and cuda:1 are one)", value=device_type),
    Field("attention_backend", "torch or Triton attention, as resolved"),
    Field("model_backend", "our decoder or transformers' forward, as resolved"),
    *(_engine_field(name, identity) for name, identity in _ENGINE.items() if identity.compared),
    Field("numerics.batch_invariant", "the probe's verdict: whether a row's bits depend on its step"),
    Field("numerics.linear", "the GEMM's construction (the fixed-order GEMM with its order version)"),
    Field("numerics.portable", "whether the bits are the same on every CPU"),
    Field("numerics.math", "the portable math's version (numerics.PORTABLE_MATH)"),
    Field("numerics.cpu_capability", "ATen's kernels for this instruction set (not compared where portable)",
          when=not_portable),
    Field("numerics.device_capability", "the GPU's compute capability"),
    Field("numerics.hardware", "the CPU vendor and model, the GPU: a library GEMM's path follows them (compared "
          "where the GEMM is a library one, the pad-16 fallback too, or the probe failed)", when=machine_gemm),
    Field("numerics.blas", "torch's BLAS and the environment that steers it (as hardware)", when=machine_gemm),
    Field("versions.torch", "torch's kernels"),
    Field("versions.transformers", "transformers' configs, tokenizers, rope tables and fallback forward"),
    Field("versions.tokenizers", "the tokenizer's code"),
    Field("versions.triton", "the compiled Triton kernels"),
    Field("versions.lm_eval", "lm-eval builds the requests (their tokens are the key) and the metrics, never a "
          "response", RUNS),
)

# Recorded, never compared: field -> why it cannot change a bit
NOT_BITS: dict[str, str] = {
    **{f"engine.{name}": identity.why for name, identity in _ENGINE.items() if not identity.compared},
    "numerics.torch_threads": "threads split output columns or rows, never a sum",
    "numerics.simd": "apcscore's scalar, AVX2 and AVX-512 copies give the same bits by construction",
    "numerics.reason": "the probe's failure in words (batch_invariant says it)",
    "numerics.probe": "what the probe checked and its timing (batch_invariant says the verdict)",
}
KNOWN = frozenset(f.path for f in FIELDS) | frozenset(NOT_BITS)


def lookup(meta: Meta, path: str) -> Any:
    """The value at a dotted `path` of `meta` (None where any part is absent)."""
    value: Any = meta
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def view(meta: Meta, name: str) -> dict[str, Any]:
    """The identity of the run `meta` as the view `name` compares it: {dotted path: value}, plain JSON."""
    out: dict[str, Any] = {}
    for field in FIELDS:
        if name in field.views and (field.when is None or field.when(meta)):
            value = lookup(meta, field.path)
            out[field.path] = field.value(value) if field.value else value
    for section in SECTIONS:
        for key, value in (meta.get(section) or {}).items():
            if f"{section}.{key}" not in KNOWN:  # a field nobody classified yet: compared, to be safe
                out[f"{section}.{key}"] = value
    return json.loads(json.dumps(out, sort_keys=True, default=str))


def short(value: Any, width: int = 100) -> str:
    """`value` as compact JSON, cut to `width` characters."""
    text = json.dumps(value, ensure_ascii=False, sort_keys=True)
    return text if len(text) <= width else text[:width - 3] + "..."


def differing(a: Meta, b: Meta, name: str, labels: tuple[str, str] = ("", "")) -> list[str]:
    """Where runs `a` and `b` differ in the view `name`, each as `path: A vs B` (`labels` name the two runs, e.g.
    ("partial ", "this run "); a dict's differing keys each named); empty when the view accepts them as one."""
    x, y = view(a, name), view(b, name)
    pairs = []
    for path in sorted(x.keys() | y.keys()):
        u, v = x.get(path), y.get(path)
        if isinstance(u, dict) and isinstance(v, dict):
            pairs += [(f"{path}.{k}", u.get(k), v.get(k)) for k in sorted(u.keys() | v.keys()) if u.get(k) != v.get(k)]
        elif u != v:
            pairs.append((path, u, v))
    if labels[0]:
        return [f"{path}: {labels[0]}{short(u, 80)}, {labels[1]}{short(v, 80)}" for path, u, v in pairs]
    return [f"{path}: {short(u, 80)} vs {short(v, 80)}" for path, u, v in pairs]


def code_changed(diffs: list[str]) -> bool:
    """Whether `diffs` (differing) name apcscore's version or its numerics code."""
    return any(d.startswith(("apcscore_version:", "code.")) for d in diffs)


def resume_check(old: Meta, new: Meta) -> list[str]:
    """The results writer's check of a resumed partial (`old`) against this run (`new`): the RESUME view."""
    diffs = differing(old, new, RESUME, ("partial ", "this run "))
    if code_changed(diffs):
        diffs.insert(0, "this apcscore computes other bits than the one that wrote the partial")
    return diffs
