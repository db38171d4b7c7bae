"""The run layer: one driver for score / generate / perplexity, above the jobs and the executors."""
