"""`apcscore eval`, the command: its options resolved and checked (command line > --config FILE > defaults,
jobs/resolve.py), --out and --gen-kwargs checked before anything loads, then one process (lmeval/run.py) or the
shards on Ray (lmeval/scale.py)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

from apcscore.jobs.options import EvalOptions
from apcscore.jobs.resolve import resolve_options
from apcscore.lmeval import outdir
from apcscore.lmeval.run import check_gen_kwargs, evaluate, import_lm_eval, split_tasks

BATCH_SIZE_NOTE = "note: the engine batches by token budget; --batch-size is ignored"


def run_eval(cli: Mapping[str, Any], echo: Any, note: Any = None) -> int:
    """Run `apcscore eval` with its command-line values (the parameters of EvalOptions and `config`, the
    --config FILE; None = not given); return the exit code (0 done, 130 interrupted: the finished responses
    are kept for --resume). echo: prints a line of the results; note: prints a line about the run (default:
    echo).

    The options are resolved first (command line > --config FILE > defaults, jobs/resolve.py), then --out and
    --gen-kwargs are checked, before the tasks and the model load."""
    import_lm_eval()
    note = note or echo
    config_path = cli.get("config")
    opts: EvalOptions = resolve_options("eval", {k: v for k, v in cli.items() if k != "config"},
                                        Path(config_path) if config_path is not None else None)
    split_tasks(opts.tasks)
    if opts.out is None:
        opts = replace(opts, out=f"results/eval-{time.strftime('%Y%m%d-%H%M%S')}")
    outdir.check_out(Path(opts.out), opts)
    if opts.gen_kwargs is not None:
        check_gen_kwargs(opts.gen_kwargs)
    if opts.batch_size is not None:
        note(BATCH_SIZE_NOTE)
    if opts.ray is not None:
        from apcscore.lmeval.scale import eval_on_ray

        return eval_on_ray(opts, echo, note)
    return evaluate(opts, echo, note)
