"""Reading datasets (reader: the strict JSONL reader; schemas: each command's record kinds) and writing
results (writer: the crash-safe, resumable parquet writer)."""
