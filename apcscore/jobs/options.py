"""The options of score / generate / perplexity: which command reads which, their types and checks, and how
command line, `--config FILE` (TOML) and defaults merge (command line > config file > defaults).

Every value is checked here, before the dataset is read and long before a model loads: a config file's value
of the wrong type, a key of another command, a sampling option out of range (checked by the very checks
SamplingParams and generate records use, `RECORD_FIELDS`). Problems are `ApcscoreError`s (exit 2) that name
the option, or the config file and line.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Callable

from apcscore.config import EngineConfig
from apcscore.engine.sampling_params import RECORD_FIELDS
from apcscore.errors import ApcscoreError, shown

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ENGINE_KEYS = frozenset(EngineConfig().to_dict())

DEFAULTS: dict[str, Any] = {
    "model": "smollm2-135m", "out": None, "overwrite": False, "resume": False, "limit": None,
    "skip_invalid": False, "quiet": False, "no_prefix_caching": False, "no_cuda_graphs": False,
    "no_batch_invariant": False, "prompt_logprobs": None, "logprobs": None,
    "max_tokens": 16, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "stop": None,
    "window": None, "stride": None, "truncate": None, "columns": None, "verify_reuse": None,
    "shard": None, "partition": "prefix", "ray": None, "replicas": 1, "gpus_per_replica": None,
    "cpus_per_replica": None,
    **EngineConfig().to_dict(),
}

_COMMON = frozenset({"model", "out", "overwrite", "resume", "limit", "skip_invalid", "quiet", "columns",
                     "no_prefix_caching", "no_cuda_graphs", "no_batch_invariant", "verify_reuse",
                     "shard", "partition", "ray", "replicas", "gpus_per_replica", "cpus_per_replica"}) | ENGINE_KEYS
# the options only one or two commands read; a config file may not set another command's option
COMMAND_KEYS: dict[str, frozenset[str]] = {
    "score": _COMMON | {"prompt_logprobs", "truncate"},
    "generate": _COMMON | {"max_tokens", "temperature", "top_p", "top_k", "stop", "logprobs", "prompt_logprobs",
                           "truncate"},
    "perplexity": _COMMON | {"window", "stride", "prompt_logprobs"},
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# key -> (what it must be, test); None is always allowed where the default is None
_TYPES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    **{k: ("true or false", lambda v: isinstance(v, bool))
       for k in ("overwrite", "resume", "skip_invalid", "quiet", "no_prefix_caching", "enable_prefix_caching",
                 "use_cuda_graphs", "no_cuda_graphs", "batch_invariant", "no_batch_invariant",
                 "exact_reuse")},
    **{k: ("a string", lambda v: isinstance(v, str))
       for k in ("model", "out", "device", "dtype", "attention_backend", "model_backend", "truncate", "columns",
                 "shard", "partition", "ray")},
    **{k: ("an integer", _is_int)
       for k in ("limit", "prompt_logprobs", "logprobs", "max_tokens", "top_k", "seed", "window", "stride",
                 "block_size", "num_kv_blocks", "max_batch_tokens", "max_num_seqs", "max_logprobs",
                 "logprobs_chunk_size", "max_model_len", "replicas")},
    **{k: ("a number", _is_number) for k in ("temperature", "top_p", "kv_cache_memory_fraction", "verify_reuse",
                                             "gpus_per_replica", "cpus_per_replica")},
    "stop": ("a string or a list of strings",
             lambda v: isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))),
}
# lower bounds of integer options (the engine settings are checked by EngineConfig itself)
_AT_LEAST = {"limit": 1, "window": 1, "stride": 1, "prompt_logprobs": 0, "logprobs": 0, "replicas": 1,
             "gpus_per_replica": 0, "cpus_per_replica": 0}


def option_name(key: str) -> str:
    """`max_tokens` -> `--max-tokens`."""
    return "--" + key.replace("_", "-")


def _config_line(text: str, key: str) -> int | None:
    """The line of the config file that sets `key` (for FILE:LINE messages), if it can be found."""
    pattern = re.compile(rf"^\s*[\"']?{re.escape(key)}[\"']?\s*=")
    for lineno, line in enumerate(text.splitlines(), start=1):
        if pattern.match(line):
            return lineno
    return None


def read_config(path: Path, command: str) -> dict[str, Any]:
    """The options of a TOML config file for `command`, type-checked; problems name FILE:LINE."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ApcscoreError(f"{path}: config file not found — check the --config path") from None
    except IsADirectoryError:
        raise ApcscoreError(f"{path}: is a directory, not a config file — give a TOML file such as "
                            f"configs/{command}.toml") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ApcscoreError(f"{path}: cannot read the config file ({exc}) — give a readable UTF-8 TOML file") from None
    try:
        values = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ApcscoreError(f"{path}: not valid TOML: {exc} — fix the syntax (see configs/{command}.toml)") from None
    problems = []
    for key, value in values.items():
        where = f"{path}:{_config_line(text, key) or 1}"
        if key not in DEFAULTS:
            problems.append(f"{where}: unknown option {key!r} — known: {', '.join(sorted(COMMAND_KEYS[command]))}")
        elif key not in COMMAND_KEYS[command]:
            users = [c for c, keys in COMMAND_KEYS.items() if key in keys]
            problems.append(f"{where}: {key!r} is an option of {' and '.join(users)}, not of {command} — remove it "
                            f"or use a config file per command")
        elif (why := type_problem(key, value)) is not None:
            problems.append(f"{where}: {key} {why} — fix the value")
    if problems:
        raise ApcscoreError("\n".join(problems))
    return values


def type_problem(key: str, value: Any) -> str | None:
    """Why `value` is not of the type option `key` takes, or None."""
    if value is None:
        return None
    what, test = _TYPES[key]
    if not test(value):
        return f"must be {what}, not {shown(value)}"
    return None


def resolve_options(command: str, cli: dict[str, Any], config_path: Path | None) -> dict[str, Any]:
    """Merge command line (non-None values) over the config file over DEFAULTS, then check every value."""
    from_file = read_config(config_path, command) if config_path is not None else {}
    merged = dict(DEFAULTS)
    merged.update(from_file)
    # None (and False for on/off flags) means "not given on the command line"
    merged.update({k: v for k, v in cli.items() if v is not None and v is not False and v != []})
    check_options(command, merged)
    return merged


def check_options(command: str, opts: dict[str, Any]) -> None:
    """Refuse values no run could use; the sampling options by the checks generate records get."""
    for key, value in opts.items():
        if (why := type_problem(key, value)) is not None:
            raise ApcscoreError(f"{option_name(key)} {why}")
    for key, low in _AT_LEAST.items():
        if opts.get(key) is not None and opts[key] < low:
            raise ApcscoreError(f"{option_name(key)} must be at least {low}, not {opts[key]}")
    if opts.get("truncate") not in (None, "left"):
        raise ApcscoreError(f"--truncate must be 'left' (drop a too-long prompt's oldest tokens), "
                            f"not {shown(opts['truncate'])}")
    if opts.get("verify_reuse") is not None:
        if not 0 <= opts["verify_reuse"] <= 1:
            raise ApcscoreError(f"--verify-reuse must be a fraction of the records in [0, 1], not {opts['verify_reuse']}")
        if not opts.get("exact_reuse"):
            raise ApcscoreError("--verify-reuse checks --exact-reuse against full recompute; pass --exact-reuse too")
    check_scale_options(opts)
    if opts["overwrite"] and opts["resume"]:
        raise ApcscoreError("--resume and --overwrite contradict each other: --resume continues <out>.partial, "
                            "--overwrite discards it — pass only one")
    if command == "generate":
        for key, check in RECORD_FIELDS.items():
            value = opts.get(key)
            if value is None or (key == "stop" and value == []):
                continue
            values = value if key == "stop" and isinstance(value, list) else [value]
            for v in values:
                if (why := check(v)) is not None:
                    raise ApcscoreError(f"{option_name(key)} {why} (the same check as a record's {key!r})")


def check_scale_options(opts: dict[str, Any]) -> None:
    """--shard, --partition, --ray and the replica options (apcscore/scale/)."""
    from apcscore.scale.partition import METHODS, parse_shard

    if opts.get("shard") is not None:
        parse_shard(opts["shard"])
    if opts.get("partition") not in METHODS:
        raise ApcscoreError(f"--partition must be one of {', '.join(METHODS)}, not {shown(opts.get('partition'))}")
    if opts.get("ray") is None:
        given = [k for k in ("gpus_per_replica", "cpus_per_replica") if opts.get(k) is not None]
        given += ["replicas"] if opts.get("replicas", 1) != 1 else []
        if given:
            raise ApcscoreError(f"{option_name(given[0])} sets up Ray replicas; pass --ray auto (join a cluster) or "
                                "--ray local (start one here) too")
        return
    if opts.get("shard") is not None:
        raise ApcscoreError("--shard and --ray contradict each other: --ray splits the dataset over its replicas "
                            "itself; --shard is for array jobs without Ray — pass only one")


def engine_config(opts: dict[str, Any]) -> EngineConfig:
    """The EngineConfig of merged options (the `no_*` flags turn their setting off)."""
    values = {k: opts[k] for k in ENGINE_KEYS}
    for flag, key in (("no_prefix_caching", "enable_prefix_caching"), ("no_cuda_graphs", "use_cuda_graphs"),
                      ("no_batch_invariant", "batch_invariant")):
        if opts.get(flag):
            values[key] = False
    return EngineConfig(**values)
