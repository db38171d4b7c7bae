"""`python -m apcscore.lmeval ARGS...`: lm-eval 0.4.13's own command line, with the model "apcscore" registered.

Every lm-eval flag works as with `lm-eval` / `python -m lm_eval` (the arguments go to lm-eval untouched):

    python -m apcscore.lmeval --model apcscore --model_args pretrained=smollm2-135m,dtype=float32 \\
        --tasks hellaswag --limit 10 --log_samples --output_path results/

`apcscore lm-eval ARGS...` (cli.py) runs the same `main`. Installed with `pip install -e .`, apcscore also
declares the entry point `lm_eval.models: apcscore = apcscore.lmeval.model:ApcscoreLM` (pyproject.toml), for
lm-eval releases that load model plugins (lm-eval PR #4013); 0.4.13 does not, hence this module.
"""

from __future__ import annotations

import sys

from apcscore.errors import ApcscoreError


def main(argv: list[str] | None = None) -> None:
    """Register the backend, then run lm-eval's CLI on `argv` (default: this process's arguments)."""
    import apcscore.lmeval.model  # noqa: F401  (registers "apcscore" after lm-eval's built-in models)
    from lm_eval.__main__ import cli_evaluate  # lm-eval's console script (`lm-eval`, `lm_eval`)

    saved = sys.argv
    sys.argv = ["lm-eval", *(sys.argv[1:] if argv is None else argv)]  # lm-eval's HarnessCLI reads sys.argv
    try:
        cli_evaluate()
    except ApcscoreError as e:  # a problem the user can fix (a model path, a setting): one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(e.exit_code) from None
    finally:
        sys.argv = saved


if __name__ == "__main__":
    main()
