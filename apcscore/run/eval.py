"""`apcscore eval` on the run layer: options, the output folder, signals, resume, timings and exit codes here;
lm-eval's side (the model class, request translation, tasks, results) in lmeval/. The order of its steps:
docs/architecture.md, "Data flow"; SIGINT/SIGTERM stop it after the current engine step: exit 130."""

from __future__ import annotations

import json
import time
from contextlib import closing
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping

from apcscore.errors import ApcscoreError
from apcscore.io.identity import EVAL, view
from apcscore.io.result_tables import write_atomic
from apcscore.run.metadata import add_timings
from apcscore.options.commands import EvalOptions
from apcscore.options.resolve import resolve_options
from apcscore.lmeval.results import config_sections, run_info, tables
from apcscore.lmeval.store import ResponseStore
from apcscore.lmeval.tasks import EvalPlan, import_lm_eval, load_tasks, plan, simple_evaluate, split_tasks
from apcscore.run import eval_folder
from apcscore.run.eval_shards import prepare_merge
from apcscore.run.signals import EXIT_INTERRUPTED, Interrupted, stop_on_signals
from apcscore.scale.partition import assign_prompts

BATCH_SIZE_NOTE = "note: the engine batches by token budget; --batch-size is ignored"


def run_eval(cli: Mapping[str, Any], echo: Callable[[str], None], note: Callable[[str], None]) -> int:
    """Run `apcscore eval` with its command-line values (EvalOptions' parameters and `config`; None = not given);
    the exit code (0 done, 130 interrupted, the finished responses kept for --resume). echo: a line of the results;
    note: a line about the run."""
    import_lm_eval()
    config_path = cli.get("config")
    opts: EvalOptions = resolve_options("eval", {k: v for k, v in cli.items() if k != "config"},
                                        Path(config_path) if config_path is not None else None)
    split_tasks(opts.tasks)  # --tasks checked before --out, --gen-kwargs after it, as before
    if opts.out is None:
        opts = replace(opts, out=f"results/eval-{time.strftime('%Y%m%d-%H%M%S')}")
    eval_folder.check_out(Path(opts.out), opts)
    parsed = plan(opts)
    if opts.batch_size is not None:
        note(BATCH_SIZE_NOTE)
    return evaluate(opts, parsed, echo, note)


def evaluate(opts: EvalOptions, parsed: EvalPlan, echo: Any, note: Any, shards: list[Path] | None = None,
             engine: Any = None) -> int:
    """One eval process: load the tasks and the model, answer lm-eval's requests from the journal (and --cache) or the
    engine, write the results (a --shard run: shard.json). shards: the folders a merge reads every response from,
    with `engine` their stand-in (run/eval_shards.RecordedEngine: no weights)."""
    out = Path(opts.out)
    manager = load_tasks(parsed.tasks, opts.include_path)
    if opts.overwrite:
        eval_folder.clear(out)
    started = time.perf_counter()
    if engine is not None or opts.ray is None:
        return _evaluate(opts, parsed, manager, echo, note, started, shards, engine)
    from apcscore.models.loaded import load_model
    from apcscore.run.ray_engine import RayEngine

    with closing(RayEngine("eval", opts, load_model(opts.model))) as ray_engine:  # the weights on the replicas
        return _evaluate(opts, parsed, manager, echo, note, started, None, ray_engine)


def _evaluate(opts: EvalOptions, parsed: EvalPlan, manager: Any, echo: Any, note: Any, started: float,
              shards: list[Path] | None, engine: Any) -> int:
    """`evaluate` once the tasks are loaded and the engine (if not this process's own) is built."""
    from apcscore.lmeval.model import ApcscoreLM
    from apcscore.lmeval.requests import write_outputs, write_samples

    out = Path(opts.out)
    lm = ApcscoreLM(pretrained=opts.model, max_length=opts.max_length, seed=opts.engine.seed,
                    progress=not opts.quiet, engine=engine, config=opts.engine)
    load_seconds = time.perf_counter() - started
    sections = config_sections(lm.engine, opts.engine)
    ident = view(sections, EVAL)  # the responses' identity (their store's name)
    resumed = eval_folder.start(out, eval_folder.run_record(opts, ident), opts.resume)
    caches = [opts.cache] if opts.cache is not None else []
    store = ResponseStore(ident, folders=[*(shards or []), *caches], journals=[out, *caches])
    for text in store.notes:
        note(text)
    lm.use_store(store, shard_split(parsed.shard, opts), strict=shards is not None)
    if shards is not None:
        store.write_all()  # the merged folder's journal holds every response: a cache for later runs
    if resumed or store.read:
        note(f"{store.read} finished responses read ({store.name}{' in ' + str(out) if resumed else ''}"
             f"{', ' + str(opts.cache) if caches else ''})")
    try:
        with stop_on_signals() as check_stop:
            lm.on_step = check_stop
            results = simple_evaluate(lm, manager, parsed, opts)
    except Interrupted:
        note(f"interrupted: {lm.computed} responses computed in this session, {len(store)} kept in "
             f"{out / store.name}; rerun the same command with --resume to continue")
        return EXIT_INTERRUPTED
    except ValueError as exc:  # random.sample in lm-eval's few-shot sampler: more shots than its split holds
        if "larger than population" not in str(exc):
            raise
        store.close()
        if not resumed:
            eval_folder.clear(out)  # the run that was just started computed nothing worth keeping
        asked = f"--num-fewshot {opts.num_fewshot}" if opts.num_fewshot is not None else "a task's num_fewshot"
        raise ApcscoreError(f"{asked} asks for more few-shot examples than a task's few-shot split holds (lm-eval: "
                            f"{exc}) — choose a smaller --num-fewshot") from None
    finally:
        lm.on_step = None
        store.close()
    if results is None:
        raise ApcscoreError("lm-eval returned no results")
    run_seconds = time.perf_counter() - started - load_seconds
    counts = {"store": store.name, "computed": lm.computed, "read": lm.reused, "other_shards": lm.skipped}
    timing = add_timings(None, lm.engine.counters().to_timings(load_seconds, run_seconds))
    if parsed.shard is not None:
        _write_shard(out, opts, ident, sections, counts, timing)
        if not opts.quiet:
            echo(f"shard {opts.shard}: {lm.computed} requests computed, {lm.reused} read, {lm.skipped} left to "
                 f"the other shards; wrote {out / store.name}. Join the shards with `apcscore merge OUT "
                 "SHARD_DIR...`")
        return 0
    ray = lm.engine.section() if opts.ray is not None else None  # run/ray_engine.RayEngine's replicas
    meta = run_info(sections, opts, parsed.tasks, results, timing, lm.max_length, counts, ray)
    written = write_samples(out, results if opts.log_samples else {})  # before results.json: it marks a run done
    write_outputs(out, results, meta)
    if not opts.quiet:
        for table in tables(results):
            echo(table)
        echo(f"wrote {out / 'results.json'} and {out / 'requests.parquet'}"
             + (f" and {len(written)} samples file(s) {out / 'samples_<task>.jsonl'}" if written else ""))
        if ray is not None:
            echo(f"ray: {ray['replicas']} replicas; engine requests per replica "
                 f"{[r['requests_assigned'] for r in ray['per_replica']]}")
    return 0


def shard_split(shard: tuple[int, int] | None, opts: EvalOptions) -> Callable[[list, list], list[bool]] | None:
    """For `--shard I/N`: which requests of an lm-eval call shard I computes (scale/partition.py's prefix-aware split
    over every request of the call, the same in each shard)."""
    if shard is None:
        return None
    index, count = shard
    return lambda prompts, loads: [part == index for part in assign_prompts(prompts, loads, count,
                                                                            opts.engine.block_size, opts.partition)]


def _write_shard(out: Path, opts: EvalOptions, ident: dict, sections: dict, counts: dict, timing: dict) -> None:
    record = {"shard": opts.shard, "run": eval_folder.run_record(opts, ident), "config": sections,
              "responses": counts, "timing": timing}
    write_atomic(out / eval_folder.SHARD_FILE,
                 (json.dumps(record, indent=2, sort_keys=True, default=str) + "\n").encode())


def merge_eval(out: Path, paths: list[Path], overwrite: bool, echo: Any, note: Any) -> int:
    """`apcscore merge OUT SHARD_DIR...` of eval shards: check them, then write OUT as one run would have."""
    opts, engine = prepare_merge(out, paths, overwrite)
    return evaluate(opts, plan(opts), echo, note, shards=paths, engine=engine)
