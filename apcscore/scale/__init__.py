"""Beyond one process: prefix-aware partitioning, `--shard I/N` with `apcscore merge`, and `--ray` replicas."""
