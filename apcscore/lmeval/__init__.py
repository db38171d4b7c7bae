"""apcscore inside lm-evaluation-harness: the lm-eval adapter that `apcscore eval` (run/eval.py) and `apcscore
lm-eval` run. Only this package imports `lm_eval` (the optional extra `apcscore[lmeval]`)."""
