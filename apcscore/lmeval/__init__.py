"""apcscore inside lm-evaluation-harness: the `apcscore` model backend and the `apcscore eval` command.

Everything here imports `lm_eval` (the optional extra `apcscore[lmeval]`); the rest of apcscore never imports
this package. `import apcscore.lmeval.model` registers lm-eval's model "apcscore".
"""
