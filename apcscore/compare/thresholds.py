"""`apcscore compare`'s limits: which figures are checked, against what, where each limit came from (default, config
file, option), the default gate, and the TOML reader of `--config` (no CLI code here)."""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from apcscore.compare.stats import DEFAULT_ALPHA
from apcscore.config import finite_problem, is_number
from apcscore.errors import ApcscoreError


@dataclass(frozen=True)
class Thresholds:
    """Pass/fail limits; None = not checked. Fractions, not percent (0.02 = 2 points of accuracy).

    `sources` says where each set limit came from ("default", "config <path>", "option"; absent: a default). A default
    whose figure the files cannot give is skipped with a note; a limit the user set is then a usage error (exit 2)."""

    max_ppl_ratio: float | None = None  # PPL_new / PPL_base <= this
    max_mean_kld: float | None = None  # mean KL(base || new) per position, nats, <= this
    min_top1_agreement: float | None = None  # share of positions with the same argmax >= this
    max_abs_logprob_diff: float | None = None  # max |logprob_new - logprob_base| of a target token <= this
    max_accuracy_drop: float | None = None  # accuracy_base - accuracy_new (and the same for acc_norm) <= this
    # records ok in the baseline and an error in the candidate; checked by default: one new error fails the gate
    max_new_errors: float | None = 0
    # share of records left out of every figure because they failed on either side
    max_excluded_fraction: float | None = None
    # broken numbers (NaN, +-inf, or a position scored on one side only); checked by default: one fails the gate
    max_broken: float | None = 0
    # the level alpha of the one-sided confidence bounds the margin tests read (DEFAULT_ALPHA when None)
    significance: float | None = None
    # strict: pass only when the worsening is significantly within each tolerance (default: fail only when it is
    # significantly beyond); point: judge the estimates alone, no confidence bounds
    decision: str | None = None
    sources: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        ranges = {"max_ppl_ratio": (0.0, math.inf, False), "max_mean_kld": (0.0, math.inf, True),
                  "min_top1_agreement": (0.0, 1.0, True), "max_abs_logprob_diff": (0.0, math.inf, True),
                  "max_accuracy_drop": (-1.0, 1.0, True), "max_new_errors": (0.0, math.inf, True),
                  "max_excluded_fraction": (0.0, 1.0, True), "max_broken": (0.0, math.inf, True),
                  "significance": (0.0, 0.5, False)}
        for name, (lo, hi, lo_ok) in ranges.items():
            v = getattr(self, name)
            if v is None:
                continue
            finite = finite_problem(v) is None
            if not (finite and (v >= lo if lo_ok else v > lo) and v <= hi):
                bound = f"{'>=' if lo_ok else '>'} {lo:g}" + (f" and <= {hi:g}" if math.isfinite(hi) else "")
                what = "a finite number " if not finite else ""
                raise ApcscoreError(f"--{name.replace('_', '-')} must be {what}{bound}, not {v}")
        if self.decision is not None and self.decision not in DECISIONS:
            raise ApcscoreError(f"--decision must be one of {', '.join(DECISIONS)}, not {self.decision!r}")

    @classmethod
    def defaults(cls) -> "Thresholds":
        """The default gate: limits on the distance between the two models (docs/compare.md, "The default gate")."""
        return cls(**DEFAULT_GATE)

    def given(self, source: str) -> "Thresholds":
        """These thresholds with every limit they set attributed to `source` ("option", "config <path>")."""
        return replace(self, sources={name: source for name in LIMITS + SETTINGS if getattr(self, name) is not None
                                      and name not in self.sources} | self.sources)

    def source(self, name: str) -> str:
        """Where the limit `name` came from: "default" unless a config file or an option set it."""
        return self.sources.get(name, "default")

    def override(self, other: "Thresholds") -> "Thresholds":
        """These thresholds with every value `other` sets (not None) taking precedence, with its source."""
        given = {name: v for name in LIMITS + SETTINGS if (v := getattr(other, name)) is not None}
        return replace(self, **given, sources=self.sources | {k: v for k, v in other.sources.items() if k in given})

    @property
    def alpha(self) -> float:
        return self.significance if self.significance is not None else DEFAULT_ALPHA


DECISIONS = ("margin", "strict", "point")
LIMITS = ("max_ppl_ratio", "max_mean_kld", "min_top1_agreement", "max_abs_logprob_diff", "max_accuracy_drop",
           "max_new_errors", "max_excluded_fraction", "max_broken")
SETTINGS = ("significance", "decision")

# The default gate, from the evidence table in docs/compare.md (scripts/compare_evidence.py, default model, K = 5):
# harmless changes (dtype round trips, bf16 compute, int8 weight-only, 1% weight noise, threads) reach at most
# KL 0.0026, top-1 0.955, PPL ratio 1.0047; damaging ones (2% and 5% weight noise, int4 weight-only, a zeroed
# projection) start at KL 0.010, top-1 0.91, PPL ratio 1.012. Each limit sits between, about twice from each side.
DEFAULT_GATE: dict[str, float] = {"max_ppl_ratio": 1.01, "max_mean_kld": 0.005, "min_top1_agreement": 0.93,
                                  "max_accuracy_drop": 0.02}
# The default max_mean_kld where the KL is exact (score --reference-model), not the K = 5 bound the limit above was
# chosen on: the bound is ~0.6x the exact mean at K = 5 (docs/compare.md, "Exact KL"); on the sample prompts the
# harmless candidates reach exact KL 0.0056 and the damaging ones start at 0.022.
EXACT_MEAN_KLD = 0.01


def _key_line(text: str, key: str) -> int:
    """The line of a TOML text that sets `key` (1 when it cannot be found), for FILE:LINE messages."""
    pattern = re.compile(rf"^\s*[\"']?{re.escape(key)}[\"']?\s*=")
    return next((n for n, line in enumerate(text.splitlines(), start=1) if pattern.match(line)), 1)


def load_thresholds(path: Path) -> Thresholds:
    """Read thresholds from the `[thresholds]` table of a TOML file (see configs/compare.toml)."""
    try:
        text = Path(path).read_text(encoding="utf-8-sig")  # a BOM is skipped
        data = tomllib.loads(text)
    except FileNotFoundError:
        raise ApcscoreError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ApcscoreError(f"cannot read config file {path}: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ApcscoreError(f"{path}: not valid TOML: {e}") from None
    known = LIMITS + SETTINGS
    extra = set(data) - {"thresholds"}
    if extra:
        raise ApcscoreError(f"{path}: unknown table or key {sorted(extra)}; put the limits under [thresholds]")
    table = data.get("thresholds", {})
    if not isinstance(table, dict):
        raise ApcscoreError(f"{path}: 'thresholds' must be a table ([thresholds])")
    values: dict[str, float | str] = {}
    for key, value in table.items():
        where = f"{path}:{_key_line(text, key)}"
        if key not in known:
            raise ApcscoreError(f"{where}: unknown threshold {key!r} in [thresholds]; known: "
                                f"{', '.join(sorted(known))}")
        if key == "decision":
            if value not in DECISIONS:
                raise ApcscoreError(f"{where}: [thresholds] decision must be one of {', '.join(DECISIONS)}, not "
                                    f"{value!r}")
            values[key] = value
            continue
        if not is_number(value) or finite_problem(value) is not None:
            raise ApcscoreError(f"{where}: [thresholds] {key} must be a finite number, not {value!r}")
        if key in ("max_new_errors", "max_broken") and not isinstance(value, int):  # counts, as the options take
            raise ApcscoreError(f"{where}: [thresholds] {key} must be a whole number, not {value!r} (as "
                                f"--{key.replace('_', '-')}) — fix the value")
        values[key] = float(value)
    return Thresholds(**values, sources={key: f"config {path}" for key in values})
