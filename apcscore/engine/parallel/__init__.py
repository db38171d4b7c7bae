"""Tensor parallelism: one model split over ranks (`--tensor-parallel N`), each rank holding a slice of it.

- ranks.py: the group of ranks (spawned workers or torchrun), rank 0's calls to them, devices;
- runner.py: one engine's slice on a rank (`RankSlice`), the runner that drives a step on every rank
  (`SliceRunner`), rank 0's `ParallelContext`, and the workers' serve loop;
- logprobs.py: vocabulary-parallel logprobs and logits, combined without gathering [tokens, vocab];
- spawn.py, faults.py: starting the workers and telling rank 0 when one fails.

The model side (which rows and columns a rank holds, the cross-rank sums in a fixed order) is
apcscore/models/tensor_parallel.py. A rank's part is a "slice"; `--shard I/N` (a dataset's shard) is another thing.
"""
