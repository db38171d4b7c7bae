"""apcscore inside lm-evaluation-harness: the lm-eval adapter (the model class "apcscore", request translation,
tasks, results) that `apcscore eval` runs over the run layer (run/eval.py), and `apcscore lm-eval`.

lm-eval is the optional extra `apcscore[lmeval]`: only this package imports `lm_eval`, and only the eval side
of the run layer (run/eval.py, eval_folder.py, eval_shards.py) imports this package, when an eval runs.
`import apcscore.lmeval.model` registers lm-eval's model "apcscore".
"""
