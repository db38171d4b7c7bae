"""`apcscore compare`, the CI regression gate: inputs (load, check, align two result files), metrics (per
position and per record), kl_bound (KL from stored top-K), gate (thresholds, `compare_files`), report
(console, Markdown, JSON) and command (the Typer command). Kept empty so `apcscore --help` stays fast."""
