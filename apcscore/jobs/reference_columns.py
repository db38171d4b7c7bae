"""The columns `score --reference-model` adds (engine/reference.py computes them): per scored token the exact
KL(reference || model) over the whole vocabulary, the reference's logprob of the token, delta p
(p_model(token) - p_ref(token)) and whether both models' argmaxes agree; per record `mean_kl` over its scored
tokens. Per-token columns are aligned with `token_ids` and null where a position was not scored (position 0, a
continuation's context); all of them are null for a choices record (one record, several sequences).
"""

from __future__ import annotations

import math

import pyarrow as pa

from apcscore.engine.step import TokenLogprobs

REFERENCE_FIELDS = [
    pa.field("mean_kl", pa.float64()),
    pa.field("ref_token_logprobs", pa.list_(pa.float32())),
    pa.field("token_kl", pa.list_(pa.float64())),
    pa.field("token_delta_p", pa.list_(pa.float64())),
    pa.field("token_top1_agree", pa.list_(pa.bool_())),
]
NULL_COLUMNS = {f.name: None for f in REFERENCE_FIELDS}


def reference_columns(num_tokens: int, lps: TokenLogprobs | None) -> dict:
    """The reference columns of a record of `num_tokens` tokens from its prompt logprobs' divergence."""
    if lps is None or lps.divergence is None:
        return dict(NULL_COLUMNS)
    d = lps.divergence
    columns: dict[str, list] = {f.name: [None] * num_tokens for f in REFERENCE_FIELDS[1:]}
    for i, pos in enumerate(lps.positions.tolist()):
        columns["ref_token_logprobs"][pos] = float(d.ref_logprobs[i])
        columns["token_kl"][pos] = float(d.kl[i])
        columns["token_delta_p"][pos] = float(d.delta_p[i])
        columns["token_top1_agree"][pos] = bool(d.top1_agree[i])
    # fsum: exactly rounded, so the mean does not depend on the summation order
    mean = math.fsum(d.kl.tolist()) / len(d.kl) if len(d.kl) else None
    return {"mean_kl": mean, **columns}

