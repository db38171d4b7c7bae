"""The Triton paged-attention kernel's sliding window and soft-capping (Gemma 2/3): on the CPU under
TRITON_INTERPRET=1, or on CUDA (scripts/gpu_check.sh runs every `triton`-marked test there).

- against a float64 dense reference (transformers' rule: a query at p sees keys k with p - window < k <= p;
  scores tanh(s / c) * c before masking), for windows that start inside a key tile, at a tile boundary and
  across tiles, with and without soft-capping, and against the torch backend's own window / softcap;
- batch invariance: a chunk of a prefill equals the same rows of the whole prefill bitwise, a decode step
  alone equals the same step in a batch and the whole prefill's row, with tiles wider than the window (so a
  program's later rows meet wholly masked tiles before their first visible one: the -inf guard, no NaN);
- a window longer than every sequence gives the causal kernel's bits (the masks add nothing).

Shapes are small (the interpreter is slow); tiles are 16 keys so that the windows cross several of them.
"""

from __future__ import annotations

import pytest
import torch

from apcscore.attention.torch_backend import TorchAttentionBackend
from apcscore.kernels.paged_attention import paged_attention
from apcscore.kernels.store_kv import store_kv
from test_kernels import (HAS_CUDA, INTERPRET, SMALL_TILES, Batch, SeqContent, build_batch, kernel_meta,
                          random_seq)

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(not INTERPRET and not HAS_CUDA,
                       reason="Triton kernels need CUDA; on a CPU set TRITON_INTERPRET=1 (make test does)"),
]

HKV, GROUP, HEAD_DIM, BLOCK = 2, 2, 32, 4
SCALE = 0.5  # scores of unit-variance q, k have a spread of ~3: a soft-cap of 2 changes them a lot
# (cached, new) per sequence: prefills from 0 and after a cached prefix, decodes at several positions
SHAPE = [(0, 40), (23, 30), (60, 1), (37, 1), (0, 1), (5, 9)]
WIDE_TILES = dict(block_m=64, block_n=16)  # 32 query positions x 2 heads per program: wider than the window
# vs float64: fp32 under the interpreter (numpy's exp2 and division); CUDA's exp2 and division are the
# approximate PTX ones (as in the causal kernel, whose tests allow 1e-4 against the torch backend)
ATOL = 2e-5 if INTERPRET else 1e-4


def make_seqs(shape: list[tuple[int, int]]) -> list[tuple[SeqContent, int, int]]:
    return [(random_seq(c + n, HKV, GROUP, HEAD_DIM, seed=300 + i), c, n) for i, (c, n) in enumerate(shape)]


def dense_reference(seqs: list[tuple[SeqContent, int, int]], window: int | None,
                    softcap: float | None) -> torch.Tensor:
    """[T, Hq, D] float64: each new row's attention over its own keys, computed densely."""
    rows = []
    for content, cached, new in seqs:
        q, k, v = (x.double() for x in (content.q, content.k, content.v))
        k = k.repeat_interleave(GROUP, dim=1)  # [L, Hq, D]: query head h reads kv head h // GROUP
        v = v.repeat_interleave(GROUP, dim=1)
        for p in range(cached, cached + new):
            s = torch.einsum("hd,khd->hk", q[p], k[:p + 1]) * SCALE  # [Hq, p + 1]
            if softcap:
                s = torch.tanh(s / softcap) * softcap
            if window:
                s[:, :max(0, p + 1 - window)] = float("-inf")  # keys k <= p - window
            rows.append(torch.einsum("hk,khd->hd", torch.softmax(s, -1), v[:p + 1]))
    return torch.stack(rows)


def run_kernel(batch: Batch, window: int | None, softcap: float | None, **tiles: int) -> torch.Tensor:
    """store_kv + paged_attention on copies of the caches; the real rows [T, Hq, D] on the CPU."""
    k_cache, v_cache = batch.clone_caches()
    store_kv(batch.key, batch.value, k_cache, v_cache, batch.meta.slot_mapping)
    out = torch.full_like(batch.query, float("nan"))  # stale memory: every real row must be written
    paged_attention(batch.query, k_cache, v_cache, *kernel_meta(batch.meta), SCALE, window=window,
                    softcap=softcap, out=out, **tiles)
    return out[:batch.meta.cu_seqlens_q_list[-1]].cpu()


@pytest.mark.slow
@pytest.mark.parametrize("tiles", [SMALL_TILES, WIDE_TILES], ids=["m16", "m64"])
@pytest.mark.parametrize("softcap", [None, 2.0], ids=["nocap", "cap2"])
@pytest.mark.parametrize("window", [None, 5, 16, 23], ids=lambda w: f"window{w}")
def test_windowed_soft_capped_attention_matches_dense_float64(window, softcap, tiles) -> None:
    """window 5: every row's window lies in one or two tiles; 16: rows at p = 15 mod 16 start exactly on a
    tile boundary; 23: windows span two or three tiles; None: causal (soft-cap alone)."""
    seqs = make_seqs(SHAPE)
    batch = build_batch(seqs, BLOCK, pad_rows=2, seed=5)
    got = run_kernel(batch, window, softcap, **tiles)
    want = dense_reference(seqs, window, softcap)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=0, atol=ATOL)
    # the torch backend (the CPU engine's path) agrees with the same window and soft-cap
    k_cache, v_cache = batch.clone_caches()
    ref = TorchAttentionBackend().forward(batch.query, batch.key, batch.value, k_cache, v_cache, batch.meta, SCALE,
                                          window, softcap)[:got.shape[0]].cpu()
    torch.testing.assert_close(got, ref, rtol=0, atol=ATOL)
    if window or softcap:  # the masks matter at these shapes: plain causal attention is far off
        causal = dense_reference(seqs, None, None)
        assert (causal - want).abs().max() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("tiles", [SMALL_TILES, WIDE_TILES], ids=["m16", "m64"])
@pytest.mark.parametrize("window,softcap", [(20, 3.0), (16, None), (7, None)])
def test_windowed_attention_is_batch_and_chunking_invariant(window, softcap, tiles) -> None:
    """Bitwise: a chunk of a 90-token prefill next to other sequences == the same rows of the whole prefill;
    decode at 89 alone == in a batch == the whole prefill's last row."""
    length = 90
    target = random_seq(length, HKV, GROUP, HEAD_DIM, seed=11)
    others = [random_seq(n, HKV, GROUP, HEAD_DIM, seed=40 + n) for n in (9, 30, 70)]

    def rows(seqs: list[tuple[SeqContent, int, int]], index: int, seed: int) -> torch.Tensor:
        batch = build_batch(seqs, BLOCK, pad_rows=1, seed=seed)
        out = run_kernel(batch, window, softcap, **tiles)
        cu = batch.meta.cu_seqlens_q_list
        return out[cu[index]:cu[index + 1]]

    whole = rows([(target, 0, length)], 0, seed=1)
    assert torch.isfinite(whole).all()  # rows whose first visible tile follows wholly masked ones: no NaN
    torch.testing.assert_close(whole.double(), dense_reference([(target, 0, length)], window, softcap),
                               rtol=0, atol=ATOL)
    chunk = rows([(others[0], 3, 6), (target, 25, 40), (others[1], 29, 1)], 1, seed=2)  # positions 25..64
    assert torch.equal(chunk, whole[25:65])
    alone = rows([(target, length - 1, 1)], 0, seed=3)
    batched = rows([(others[2], 0, 70), (others[1], 29, 1), (target, length - 1, 1), (others[0], 8, 1)], 2, seed=4)
    assert torch.equal(alone, batched) and torch.equal(alone, whole[-1:])


def test_windowed_soft_capped_attention_in_fp16() -> None:
    """The non-IEEE tl.dot path (P rounded to the cache dtype before P @ V), as the causal fp16 test allows."""
    seqs = [(random_seq(c + n, HKV, GROUP, HEAD_DIM, seed=300 + i, dtype=torch.float16), c, n)
            for i, (c, n) in enumerate(SHAPE)]
    batch = build_batch(seqs, BLOCK, pad_rows=2, seed=5)
    got = run_kernel(batch, 23, 2.0, **SMALL_TILES)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.double(), dense_reference(seqs, 23, 2.0), rtol=5e-3, atol=5e-3)


def test_a_window_longer_than_every_sequence_gives_the_causal_bits() -> None:
    """WINDOW on with nothing outside the window: the same bits as the causal kernel (WINDOW off)."""
    batch = build_batch(make_seqs(SHAPE), BLOCK, pad_rows=2, seed=5)
    causal = run_kernel(batch, None, None, **SMALL_TILES)
    assert torch.equal(run_kernel(batch, 10_000, None, **SMALL_TILES), causal)


def test_window_and_softcap_are_checked() -> None:
    batch = build_batch(make_seqs([(2, 3)]), BLOCK)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="window must be a positive int"):
            paged_attention(batch.query, batch.k_cache, batch.v_cache, *kernel_meta(batch.meta), window=bad)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="softcap must be positive"):
            paged_attention(batch.query, batch.k_cache, batch.v_cache, *kernel_meta(batch.meta), softcap=bad)
