"""Tensor parallelism (`--tensor-parallel N`): one model split over ranks, each holding a slice of it. The modules
(ranks, runner, logprobs, spawn, faults): docs/architecture.md, "Layout"; the model side: models/tensor_parallel.py.
A rank's part is a "slice"; `--shard I/N` (a dataset's shard) is another thing.
"""
