"""Cost of the results writer's part files: 2,000 score rows of 60 tokens with top-5,
written with parts of 256, 16 and 1 rows. Run: PYTHONPATH=. python benchmarks/writer_flush.py"""
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from apcscore.io.writer import ResultsWriter
from apcscore.jobs.base import COMMON_FIELDS, TOKEN_FIELDS
schema = pa.schema(COMMON_FIELDS + [pa.field("sum_logprob", pa.float64())] + TOKEN_FIELDS)
def row(i):
    n = 60
    return {"id": str(i), "status": "ok", "error": None, "sum_logprob": -1.0, "token_ids": list(range(n)),
            "token_logprobs": [-1.0] * n, "token_ranks": [1] * n, "top_ids": [[1, 2, 3, 4, 5]] * n,
            "top_logprobs": [[-1.0] * 5] * n}
rows = [row(i) for i in range(2000)]
for label, group, secs in (("one part per 256 rows (old bound)", 256, 1e9),
                           ("one part per row (worst case of a 1 s bound)", 1, 1e9),
                           ("one part per 16 rows", 16, 1e9)):
    d = Path(tempfile.mkdtemp())
    w = ResultsWriter(d / "o.parquet", schema, {"command": "score"}, row_group_size=256, num_rows=len(rows),
                      max_buffer_seconds=secs)
    t0 = time.perf_counter()
    buf = 0
    for i, r in enumerate(rows):
        w.add(i, r)
        buf += 1
        if buf == group:
            w.flush()
            buf = 0
    t1 = time.perf_counter()
    w.close()
    t2 = time.perf_counter()
    parts = -(-len(rows) // group)
    print(f"{label}: {parts} parts, add+flush {1e3*(t1-t0)/parts:.2f} ms per part "
          f"({1e3*(t1-t0):.0f} ms for 2000 rows), close/merge {1e3*(t2-t1):.0f} ms")
    shutil.rmtree(d)
