"""The one converter from a command's parsed arguments to its options: command line > `--config FILE` (TOML) >
defaults (options/commands.py declares them), merged and every value checked before the dataset is read
(`resolve_options`). A problem is an `ApcscoreError` (exit 2) that names the option as the user gave it: the flag
they typed (`specs.in_flags`), or the config file and line.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Mapping

from apcscore.config import RECORD_FIELDS, TYPE_CHECKS, ConfigError, finite_problem
from apcscore.errors import ApcscoreError, shown
from apcscore.io.openai_batch import INPUT_FORMATS, OUTPUT_FORMATS
from apcscore.options.commands import COMMANDS, Options, RunOptions, Setting, defaults, settings
from apcscore.options.specs import NOT_GIVEN, base_type, in_flags, option_name

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

PARTITION_METHODS = ("prefix", "random")  # how --shard and --ray split the records (scale/partition.py)


def resolve_options(command: str, cli: Mapping[str, Any], config_path: Path | None) -> Any:
    """The options of `command` (score, generate, perplexity: a RunOptions; eval: an EvalOptions): command line
    (`cli_values`) over the config file over the defaults, every value checked."""
    cls = COMMANDS[command]
    from_file = read_config(config_path, command) if config_path is not None else {}
    merged = {**defaults(cls), **from_file, **cli_values(cli, cls)}
    for key, s in settings(cls).items():  # required, but the command line leaves it to a --config file
        if s.default is NOT_GIVEN and merged.get(key) is None:
            raise ApcscoreError(f"{option_name(key)} is required: pass it on the command line, or set {key} in "
                                "the --config file")
    check_options(command, merged)
    try:
        opts = cls.from_values(merged)
    except ConfigError as exc:  # EngineConfig's check, in the flags the user typed
        raise ApcscoreError(in_flags(exc, cli_values(cli, cls))) from None
    cap = opts.engine.max_logprobs
    for key in ("prompt_logprobs", "logprobs"):  # a top-K above the cap: say how to raise the cap
        k = getattr(opts, key, None)
        if k is not None and k > cap:
            raise ApcscoreError(f"{option_name(key)} {k} is above the cap max_logprobs = {cap}; ask for at most "
                                f"{cap}, or raise the cap with --max-logprobs {k}")
    return opts


def cli_values(cli: Mapping[str, Any], cls: type[Options]) -> dict[str, Any]:
    """The values given on the command line: None (False for on/off flags, [] for lists) is not given; False
    is given for a flag of `cls` with an off-switch of its own (`bool | None`: `--no-fewshot-as-multiturn`)."""
    both = {k for k, s in settings(cls).items() if s.type == "bool | None"}
    return {k: v for k, v in cli.items() if v is not None and (v is not False or k in both) and v != []}


# an option's type (its annotation less `| None`) -> (what a value must be, test); None is always allowed
_TYPE_CHECKS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    **TYPE_CHECKS,  # those of EngineConfig's settings
    "Path": ("a path (a string)", lambda v: isinstance(v, (str, Path))),
    "str | list[str]": ("a string or a list of strings", lambda v: isinstance(v, str) or (
        isinstance(v, list) and all(isinstance(s, str) for s in v))),
}


def _config_line(text: str, key: str) -> int | None:
    """The line of the config file that sets `key` (for FILE:LINE messages), if it can be found."""
    name = rf"[\"']?{re.escape(key)}[\"']?"
    pattern = re.compile(rf"^\s*(?:{name}\s*[=.]|\[\[?\s*{name}\s*[\].])")  # key = ..., key.x = ..., [key], [[key]]
    for lineno, line in enumerate(text.splitlines(), start=1):
        if pattern.match(line):
            return lineno
    return None


def read_config(path: Path, command: str) -> dict[str, Any]:
    """The options of a TOML config file for `command`, type-checked; problems name FILE:LINE."""
    try:
        text = Path(path).read_text(encoding="utf-8-sig")  # a BOM (Windows editors) is skipped, as in datasets
    except FileNotFoundError:
        raise ApcscoreError(f"{path}: config file not found — check the --config path") from None
    except IsADirectoryError:
        raise ApcscoreError(f"{path}: is a directory, not a config file — give a TOML file such as "
                            f"configs/{command}.toml") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ApcscoreError(f"{path}: cannot read the config file ({exc}) — give a readable UTF-8 TOML "
                            "file") from None
    try:
        values = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ApcscoreError(f"{path}: not valid TOML: {exc} — fix the syntax (see "
                            f"configs/{command}.toml)") from None
    keys = {c: settings(cls) for c, cls in COMMANDS.items()}
    problems = []
    for key, value in list(values.items()):
        where = f"{path}:{_config_line(text, key) or 1}"
        if key == "gen_kwargs" and command == "eval" and isinstance(value, dict):
            value = values[key] = _gen_kwargs_table(value)
            if value is None:
                problems.append(f"{where}: gen_kwargs as a table takes numbers, booleans and strings without "
                                "',' or '=' (lm-eval's KEY=VALUE,... form) — fix the value")
                continue
        if not any(key in k for k in keys.values()):
            snake = key.replace("-", "_")
            hint = (f"write {snake!r}: config keys are the options' names with underscores" if snake != key
                    and any(snake in k for k in keys.values()) else f"known: {', '.join(sorted(keys[command]))}")
            problems.append(f"{where}: unknown option {key!r} — {hint}")
        elif key not in keys[command]:
            users = [c for c, k in keys.items() if key in k]
            problems.append(f"{where}: {key!r} is an option of {' and '.join(users)}, not of {command} — "
                            f"remove it or use a config file per command")
        elif (why := type_problem(keys[command][key], value)) is not None:
            problems.append(f"{where}: {key} {why} — fix the value")
    if problems:
        raise ApcscoreError("\n".join(problems))
    return values


def type_problem(setting: Setting, value: Any) -> str | None:
    """Why `value` is not of the type `setting` takes, or None."""
    if value is None:
        return None
    what, test = _TYPE_CHECKS[base_type(setting.type)]
    if not test(value):
        return f"must be {what}, not {shown(value)}"
    return finite_problem(value) if base_type(setting.type) == "float" else None


def check_options(command: str, opts: dict[str, Any]) -> None:
    """Refuse merged values (keys of `settings`) no run could use; the sampling options by the checks
    generate records get."""
    cls = COMMANDS[command]
    known = settings(cls)
    for key, value in opts.items():
        if (why := type_problem(known[key], value)) is not None:
            raise ApcscoreError(f"{option_name(key)} {why}")
    for key, s in known.items():
        low = s.spec.at_least
        if low is not None and opts.get(key) is not None and opts[key] < low:
            raise ApcscoreError(f"{option_name(key)} must be at least {low}, not {opts[key]}")
    check_scale_options(opts)
    if opts["overwrite"] and opts["resume"]:
        raise ApcscoreError(f"--resume and --overwrite contradict each other: --resume continues "
                            f"{'the unfinished run in --out' if command == 'eval' else '<out>.partial'}, "
                            "--overwrite discards it — pass only one")
    if not issubclass(cls, RunOptions):
        check_eval_options(opts)
        return
    if opts.get("truncate") not in (None, "left"):
        raise ApcscoreError(f"--truncate must be 'left' (drop a too-long prompt's oldest tokens), "
                            f"not {shown(opts['truncate'])}")
    if opts.get("verify_reuse") is not None:
        if not 0 <= opts["verify_reuse"] <= 1:
            raise ApcscoreError(f"--verify-reuse must be a fraction of the records in [0, 1], not "
                                f"{opts['verify_reuse']}")
        if not opts.get("exact_reuse"):
            raise ApcscoreError("--verify-reuse checks --exact-reuse against full recompute; pass "
                                "--exact-reuse too")
    for key, allowed in (("input_format", INPUT_FORMATS), ("output_format", (None, *OUTPUT_FORMATS))):
        if key in opts and opts[key] not in allowed:
            raise ApcscoreError(f"{option_name(key)} must be one of {', '.join(a for a in allowed if a)}, not "
                                f"{shown(opts[key])}")
    if command == "generate":
        for key, check in RECORD_FIELDS.items():
            value = opts.get(key)
            if value is None or (key == "stop" and value == []):
                continue
            values = value if key == "stop" and isinstance(value, list) else [value]
            for v in values:
                if (why := check(v)) is not None:
                    raise ApcscoreError(f"{option_name(key)} {why} (the same check as a record's {key!r})")


def check_eval_options(opts: dict[str, Any]) -> None:
    """eval's own: --fewshot-as-multiturn needs the chat template (lm-eval refuses it without), --gen-kwargs
    is lm-eval's KEY=VALUE,... (its keys are checked by lmeval/tasks.py, which knows the model's)."""
    if opts.get("fewshot_as_multiturn") and not opts.get("apply_chat_template"):
        raise ApcscoreError("--fewshot-as-multiturn makes each few-shot example a chat turn, which needs "
                            "--apply-chat-template — pass it too (or drop --fewshot-as-multiturn)")
    if opts.get("gen_kwargs") is not None:
        check_gen_kwargs_form(opts["gen_kwargs"])
    limit = opts.get("limit")
    if limit is not None and not (0 < limit < 1 or (limit >= 1 and float(limit).is_integer())):
        raise ApcscoreError(f"--limit must be a whole number of documents (at least 1) or a fraction of each "
                            f"task's documents between 0 and 1, as in lm-eval, not {shown(limit)}")


def check_gen_kwargs_form(text: str) -> None:
    """Refuse a `--gen-kwargs` that is not `k=v,k2=v2` (lmeval/tasks.check_gen_kwargs parses it as lm-eval does)."""
    for piece in (p for p in text.split(",") if p.strip()):
        key, sep, _ = piece.partition("=")
        if not sep or not key.strip():
            raise ApcscoreError(f"--gen-kwargs must be KEY=VALUE pairs separated by commas (lm-eval's form, e.g. "
                                f"temperature=0.7,do_sample=true), not {shown(text)}: {shown(piece)} is not "
                                "KEY=VALUE")


def check_scale_options(opts: dict[str, Any]) -> None:
    """--shard, --partition, --ray and the replica options (apcscore/scale/)."""
    if opts.get("shard") is not None:
        parse_shard(opts["shard"])
    if opts.get("partition") not in PARTITION_METHODS:
        raise ApcscoreError(f"--partition must be one of {', '.join(PARTITION_METHODS)}, not "
                            f"{shown(opts.get('partition'))}")
    if opts.get("ray") is None:
        given = [k for k in ("gpus_per_replica", "cpus_per_replica") if opts.get(k) is not None]
        given += ["replicas"] if opts.get("replicas", 1) != 1 else []
        if given:
            raise ApcscoreError(f"{option_name(given[0])} sets up Ray replicas; pass --ray auto (join a "
                                "cluster) or --ray local (start one here) too")
        return
    if opts.get("shard") is not None:
        raise ApcscoreError("--shard and --ray contradict each other: --ray splits the dataset over its "
                            "replicas itself; --shard is for array jobs without Ray — pass only one")
    if (opts.get("tensor_parallel_size") or 1) > 1:
        raise ApcscoreError(f"--ray with --tensor-parallel {opts['tensor_parallel_size']} is not supported yet: a "
                            "replica's ranks would need a placement group of their own; run --tensor-parallel "
                            "without --ray (one process starts its ranks), or --ray with --tensor-parallel 1")


def _gen_kwargs_table(table: dict[str, Any]) -> str | None:
    """`gen_kwargs = {max_gen_toks = 64, do_sample = false}` (a TOML table) -> lm-eval's `max_gen_toks=64,do_sample=
    false`; None when a value cannot be written so (a list, a table, a string holding ',' or '=')."""
    pieces = []
    for key, value in table.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float)):
            text = repr(value)
        elif isinstance(value, str) and not set(value) & {",", "="}:
            text = value
        else:
            return None
        pieces.append(f"{key}={text}")
    return ",".join(pieces)


def parse_shard(value: str) -> tuple[int, int]:
    """`--shard I/N` -> (I, N); I is 0-based (0 <= I < N), as Slurm's and Kubernetes' array indices usually are."""
    try:
        i_text, n_text = value.split("/")
        i, n = int(i_text), int(n_text)
    except ValueError:
        raise ApcscoreError(f"--shard must be I/N (e.g. 0/4: the first of 4 shards), not {value!r}") from None
    if n < 1:
        raise ApcscoreError(f"--shard {value}: need N >= 1 shards (and 0 <= I < N: the shards of 4 are 0/4 .. 3/4)")
    if not 0 <= i < n:
        raise ApcscoreError(f"--shard {value}: need 0 <= I < N (N >= 1; shards are numbered from 0, so "
                            f"the shards of {n} are 0/{n} .. {n - 1}/{n})")
    return i, n
