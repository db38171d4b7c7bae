"""`python -m apcscore.lmeval ARGS...` (and `apcscore lm-eval ARGS...`): lm-eval 0.4.13's own command line, its
arguments untouched, with the model "apcscore" registered (0.4.13 loads no model plugins, so pyproject.toml's
`lm_eval.models` entry point alone is not enough)."""

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
