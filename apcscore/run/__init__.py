"""The run layer: one driver for score / generate / perplexity and one for eval, each running its requests through
an engine (one here, or the Ray engine's replicas)."""
