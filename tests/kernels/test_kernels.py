"""Triton kernels against their torch references: on the CPU under TRITON_INTERPRET=1, or on CUDA.

The interpreter is slow, so shapes are small and the attention tiles are shrunk to 16 (block_m, block_n)
so that short sequences still span several query and key tiles. Under the interpreter, bf16 is only
checked where the kernel does no bf16 tl.dot (the interpreter multiplies bf16 bit patterns there) and with
a one-ulp tolerance (it truncates fp32 -> bf16 instead of rounding to nearest even as GPUs do).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from apcscore.attention.metadata import AttentionMetadata
from apcscore.attention.torch_backend import TorchAttentionBackend
from apcscore.attention.torch_backend import store_kv as store_kv_torch
from apcscore.kernels.logprobs import token_logprobs
from apcscore.kernels.logprobs_torch import token_logprobs_torch
from apcscore.kernels.rmsnorm import rms_norm
from triton_device import DEVICE, HAS_CUDA, INTERPRET, TRITON_MARKS  # noqa: E402
from apcscore.kernels.paged_attention import paged_attention
from apcscore.kernels.store_kv import store_kv


pytestmark = TRITON_MARKS
needs_real_bf16_dot = pytest.mark.skipif(
    INTERPRET, reason="the Triton interpreter's tl.dot multiplies bf16 bit patterns (triton issue #11584)")

SMALL_TILES = dict(block_m=16, block_n=16)


# ---------------------------------------------------------------------------------------------------------
# Paged batches built from per-sequence content, so one sequence can be replayed in other batches.

@dataclass
class SeqContent:
    """Every query, key and value of one sequence: [L, Hq, D], [L, Hkv, D], [L, Hkv, D]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def random_seq(length: int, num_kv_heads: int, group: int, head_dim: int, seed: int,
               dtype: torch.dtype = torch.float32) -> SeqContent:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(length, num_kv_heads * group, head_dim, generator=g)
    k = torch.randn(length, num_kv_heads, head_dim, generator=g)
    v = torch.randn(length, num_kv_heads, head_dim, generator=g)
    return SeqContent(q.to(dtype), k.to(dtype), v.to(dtype))


@dataclass
class Batch:
    query: torch.Tensor  # [T, Hq, D] new tokens of every sequence, then padding rows
    key: torch.Tensor  # [T, Hkv, D]
    value: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]: the cached prefixes, NaN everywhere else
    v_cache: torch.Tensor
    meta: AttentionMetadata

    def clone_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_cache.clone(), self.v_cache.clone()


def build_batch(seqs: list[tuple[SeqContent, int, int]], block_size: int, pad_rows: int = 0,
                seed: int = 0) -> Batch:
    """seqs: (content, num_cached, num_new) per sequence. Positions < num_cached are already in the cache;
    the next num_new are this step's tokens. Blocks are handed out in a random order (non-contiguous tables);
    unused slots hold NaN, so a kernel that reads past a sequence poisons its output."""
    g = torch.Generator().manual_seed(seed)
    first = seqs[0][0]
    _, num_heads, head_dim = first.q.shape
    num_kv_heads, dtype = first.k.shape[1], first.q.dtype
    lens = [cached + new for _, cached, new in seqs]
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    tables, rows, slots, cu = [], [], [], [0]
    for (content, cached, new), n_blocks in zip(seqs, blocks_per_seq):
        table, order = order[:n_blocks], order[n_blocks:]
        tables.append(table)
        for pos in range(cached + new):
            slot = table[pos // block_size] * block_size + pos % block_size
            if pos < cached:
                k_cache.view(-1, num_kv_heads, head_dim)[slot] = content.k[pos]
                v_cache.view(-1, num_kv_heads, head_dim)[slot] = content.v[pos]
            else:
                rows.append((content, pos))
                slots.append(slot)
        cu.append(cu[-1] + new)
    query = torch.stack([c.q[p] for c, p in rows] + [torch.randn(num_heads, head_dim, generator=g).to(dtype)
                                                      for _ in range(pad_rows)])
    key = torch.stack([c.k[p] for c, p in rows] + [torch.randn(num_kv_heads, head_dim, generator=g).to(dtype)
                                                    for _ in range(pad_rows)])
    value = torch.stack([c.v[p] for c, p in rows] + [torch.randn(num_kv_heads, head_dim, generator=g).to(dtype)
                                                      for _ in range(pad_rows)])
    block_tables = torch.zeros(len(seqs), max(blocks_per_seq), dtype=torch.int32)
    for i, table in enumerate(tables):
        block_tables[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots + [-1] * pad_rows, dtype=torch.int64, device=DEVICE),
        block_tables=block_tables.to(DEVICE),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        cu_seqlens_q_list=cu, seq_lens_list=lens, block_size=block_size)
    return Batch(query.to(DEVICE), key.to(DEVICE), value.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), meta)


def random_batch(shape: list[tuple[int, int]], *, num_kv_heads: int, group: int, head_dim: int, block_size: int,
                 dtype: torch.dtype = torch.float32, pad_rows: int = 0) -> Batch:
    seqs = [(random_seq(cached + new, num_kv_heads, group, head_dim, seed=100 + i, dtype=dtype), cached, new)
            for i, (cached, new) in enumerate(shape)]
    return build_batch(seqs, block_size, pad_rows)


def kernel_meta(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The metadata tensors the paged_attention kernel takes."""
    return meta.block_tables, meta.cu_seqlens_q, meta.seq_lens


def triton_forward(batch: Batch, scale: float, **tiles: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """store_kv + paged_attention kernels on fresh copies of the caches: (out, k_cache, v_cache)."""
    k_cache, v_cache = batch.clone_caches()
    store_kv(batch.key, batch.value, k_cache, v_cache, batch.meta.slot_mapping)
    out = torch.full_like(batch.query, float("nan"))  # stale memory: the kernel must write every real row
    got = paged_attention(batch.query, k_cache, v_cache, *kernel_meta(batch.meta), scale, **tiles, out=out)
    assert got is out
    return got, k_cache, v_cache


def torch_forward(batch: Batch, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k_cache, v_cache = batch.clone_caches()
    out = TorchAttentionBackend().forward(batch.query, batch.key, batch.value, k_cache, v_cache, batch.meta, scale)
    return out, k_cache, v_cache


# (cached, new) per sequence: a prefill over a partly cached context, a fresh prefill, decodes, and lengths
# that are not multiples of the block size.
MIXED = [(5, 7), (0, 10), (13, 1), (6, 3), (0, 1), (21, 1)]
ATTENTION_CASES = {
    "mixed-gqa3-d64": dict(shape=MIXED, num_kv_heads=2, group=3, head_dim=64, block_size=4, pad_rows=3),
    "prefill-mha-d48-bs8": dict(shape=[(0, 17), (9, 12), (3, 4)], num_kv_heads=3, group=1, head_dim=48,
                                block_size=8, pad_rows=0),
    "decode-gqa3-d64": dict(shape=[(0, 1), (4, 1), (15, 1), (30, 1), (7, 1)], num_kv_heads=1, group=3,
                            head_dim=64, block_size=4, pad_rows=2),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_matches_torch_backend_fp32(case: str) -> None:
    batch = random_batch(**ATTENTION_CASES[case])
    scale = 1.0 / math.sqrt(batch.query.shape[-1])
    want, want_k, want_v = torch_forward(batch, scale)
    got, got_k, got_v = triton_forward(batch, scale, **SMALL_TILES)
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got_v, want_v, rtol=0, atol=0, equal_nan=True)
    num_real = batch.meta.cu_seqlens_q_list[-1]
    torch.testing.assert_close(got[:num_real], want[:num_real], rtol=1e-4, atol=1e-4)  # no NaN in real rows
    assert got.shape[0] > num_real or ATTENTION_CASES[case]["pad_rows"] == 0
    assert torch.isnan(got[num_real:]).all()  # padding rows: never written (no zero-fill), slot -1 never stored
    assert torch.count_nonzero(want[num_real:]) == 0  # the torch backend zeroes its few padding rows


@pytest.mark.parametrize("head_dim", [64, 128])
def test_attention_default_tiles_and_triton_backend(head_dim: int) -> None:
    """The production tile sizes (tile_config), through TritonAttentionBackend (store, then attend)."""
    from apcscore.attention.triton_backend import TritonAttentionBackend

    batch = random_batch(MIXED, num_kv_heads=2, group=3, head_dim=head_dim, block_size=4, pad_rows=2)
    want, want_k, _ = torch_forward(batch, 0.3)
    k_cache, v_cache = batch.clone_caches()
    backend = TritonAttentionBackend()
    assert backend.name == "triton"
    got = backend.forward(batch.query, batch.key, batch.value, k_cache, v_cache, batch.meta, 0.3)
    torch.testing.assert_close(k_cache, want_k, rtol=0, atol=0, equal_nan=True)
    n = batch.meta.cu_seqlens_q_list[-1]  # the padding rows are not written
    torch.testing.assert_close(got[:n], want[:n], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=needs_real_bf16_dot)])
def test_attention_half_precision(dtype: torch.dtype) -> None:
    batch = random_batch(MIXED, num_kv_heads=2, group=3, head_dim=64, block_size=4, dtype=dtype, pad_rows=1)
    want, _, _ = torch_forward(batch, 0.125)
    got, _, _ = triton_forward(batch, 0.125, **SMALL_TILES)
    assert got.dtype == dtype
    tol = 5e-3 if dtype == torch.float16 else 3e-2  # P is rounded to the cache dtype before P @ V
    n = batch.meta.cu_seqlens_q_list[-1]  # the padding row is not written
    torch.testing.assert_close(got[:n].float(), want[:n].float(), rtol=tol, atol=tol)


def test_attention_is_batch_and_chunking_invariant() -> None:
    """A query's output is bitwise the same whether its sequence runs as one prefill, as the second chunk of
    a chunked prefill next to other sequences, or as a decode step in yet another batch and block layout."""
    length, hkv, group, d, bs = 37, 2, 3, 64, 4
    target = random_seq(length, hkv, group, d, seed=7)
    others = [random_seq(n, hkv, group, d, seed=20 + n) for n in (9, 14, 30)]

    def rows_of_target(seqs: list[tuple[SeqContent, int, int]], index: int, seed: int) -> torch.Tensor:
        batch = build_batch(seqs, bs, pad_rows=1, seed=seed)
        out, _, _ = triton_forward(batch, 0.125, **SMALL_TILES)
        cu = batch.meta.cu_seqlens_q_list
        return out[cu[index]:cu[index + 1]]

    whole = rows_of_target([(target, 0, length)], 0, seed=1)  # [37, Hq, D], positions 0..36
    chunk = rows_of_target([(others[0], 3, 6), (target, 11, 19), (others[1], 13, 1)], 1, seed=2)  # 11..29
    decode = rows_of_target([(others[2], 0, 30), (others[1], 13, 1), (target, 36, 1)], 2, seed=3)  # 36
    assert torch.equal(chunk, whole[11:30])
    assert torch.equal(decode, whole[36:])
    # The property is not vacuous: other key tile sizes reduce in another order and give other bits.
    batch = build_batch([(target, 0, length)], bs, seed=1)
    other_tiles, _, _ = triton_forward(batch, 0.125, block_m=16, block_n=32)
    torch.testing.assert_close(other_tiles, whole, rtol=1e-5, atol=1e-5)
    assert not torch.equal(other_tiles, whole)


def test_attention_runs_one_kernel_for_every_block_table_width() -> None:
    """The block table's width is the batch's longest sequence in blocks: a query's output is bitwise the same
    at widths 1, 16 and 19 (table columns past a sequence's blocks are never read), and on CUDA those widths
    (== 1, divisible by 16, neither: the value classes Triton specialises on) share one compiled kernel."""
    from apcscore.kernels.paged_attention import _paged_attention_kernel

    target = random_seq(3, 2, 3, 64, seed=5)
    batch = build_batch([(target, 0, 3)], 4, seed=1)  # 3 tokens in one 4-token block: width 1
    compiled = []
    outs = []
    for width in (1, 16, 19):
        tables = torch.zeros(1, width, dtype=torch.int32, device=DEVICE)
        tables[:, :1] = batch.meta.block_tables
        k_cache, v_cache = batch.clone_caches()
        store_kv(batch.key, batch.value, k_cache, v_cache, batch.meta.slot_mapping)
        outs.append(paged_attention(batch.query, k_cache, v_cache, tables, batch.meta.cu_seqlens_q,
                                    batch.meta.seq_lens, 0.125, **SMALL_TILES))
        if DEVICE == "cuda":  # Triton's in-process cache of compiled variants (triton.runtime.jit.JITFunction)
            compiled.append(len(_paged_attention_kernel.device_caches[torch.cuda.current_device()][0]))
    assert all(torch.equal(out, outs[0]) for out in outs[1:])
    assert compiled == [] or compiled[1:] == [compiled[0]] * 2, compiled


# Integer kernel arguments whose value changes with the batch. Triton compiles a variant per value class of an
# integer argument (== 1, divisible by 16, other) unless it is in the kernel's do_not_specialize; each of these
# must be, so that every batch runs the same compiled code.
BATCH_DEPENDENT_ARGS = {"paged_attention._paged_attention_kernel": {"num_seqs", "stride_bt"},
                        "paged_decode_shared._shared_prefix_decode_kernel": {"stride_bt"},
                        "matmul._linear_kernel": {"M"}, "matmul._linear_tma_persistent_kernel": {"M"},
                        # the largest top-k of the batch's requests (logprobs.FUSED_TOP_K_MAX)
                        "logprobs._token_logprobs_kernel": {"k"}}


def test_kernels_do_not_specialise_on_the_batch() -> None:
    script = textwrap.dedent(f"""
        import importlib
        for path, names in {BATCH_DEPENDENT_ARGS!r}.items():
            module, kernel = path.split(".")
            fn = getattr(importlib.import_module("apcscore.kernels." + module), kernel)
            exempt = {{p.name for p in fn.params if p.do_not_specialize}}
            assert set(names) <= exempt, (path, sorted(set(names) - exempt))
            assert set(names) <= set(fn.arg_names), (path, "no such argument")
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the JIT's own kernel objects
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60,
                            cwd=Path(__file__).parents[2])
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


# ---------------------------------------------------------------------------------------------------------
# store_kv

@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_store_kv_matches_torch(cache_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    num_blocks, bs, hkv, d, t = 6, 4, 3, 48, 9
    fused = torch.randn(t + 2, 2 * hkv * d + 5, generator=g)  # key/value are strided views of a wider tensor
    key = fused[:t, :hkv * d].view(t, hkv, d)
    value = fused[:t, hkv * d:2 * hkv * d].view(t, hkv, d)
    slots = torch.randperm(num_blocks * bs, generator=g)[:t]
    slots[[2, 7]] = -1
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(cache_dtype)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(cache_dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    store_kv_torch(key, value, want_k, want_v, slots)
    got_k, got_v = k_cache.clone().to(DEVICE), v_cache.clone().to(DEVICE)
    store_kv(key.to(DEVICE), value.to(DEVICE), got_k, got_v, slots.to(DEVICE))
    assert torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v)
    assert not torch.equal(want_k, k_cache)  # something was written


# ---------------------------------------------------------------------------------------------------------
# rms_norm, against transformers' LlamaRMSNorm itself

def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(weight.shape[0], eps=eps).to(device=x.device, dtype=weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        return norm(x)


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                             (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_rms_norm_matches_hf(x_dtype: torch.dtype, w_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    wide = 3 * torch.randn(5, 130, generator=g)
    wide[1] *= 1e-3  # mean(x^2) ~ 1e-5, the size of eps: a kernel that drops eps fails on this row
    wide = wide.to(x_dtype).to(DEVICE)
    x = wide[:, :100]  # strided rows, hidden 100 (not a power of two)
    residual = torch.randn(5, 100, generator=g).to(x_dtype).to(DEVICE)
    weight = (1 + 0.3 * torch.randn(100, generator=g)).to(w_dtype).to(DEVICE)
    x_before = x.clone()
    # Relative tolerance by the precision of h.to(x.dtype): one ulp, two under the interpreter, which
    # truncates fp32 -> bf16 where GPUs round to nearest even.
    rtol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 3e-2 if INTERPRET else 1.6e-2}[x_dtype]

    got = rms_norm(x, weight, 1e-5)
    want = hf_rms_norm(x, weight, 1e-5)
    assert got.dtype == want.dtype == torch.promote_types(x_dtype, w_dtype)
    torch.testing.assert_close(got, want, rtol=rtol, atol=1e-5)

    got_out, got_res = rms_norm(x, weight, 1e-5, residual=residual)
    want_res = x + residual
    torch.testing.assert_close(got_res, want_res, rtol=rtol, atol=1e-5)
    torch.testing.assert_close(got_out, hf_rms_norm(want_res, weight, 1e-5), rtol=rtol, atol=1e-5)
    assert torch.equal(x, x_before)  # out of place


# ---------------------------------------------------------------------------------------------------------
# token_logprobs

def independent_reference(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs in float64 and ranks by sorting: a second derivation to check token_logprobs_torch against."""
    logprobs = torch.log_softmax(logits.double(), -1).gather(1, targets[:, None]).squeeze(1)
    ascending = logits.float().sort(dim=-1).values
    target_logits = logits.float().gather(1, targets[:, None])
    above = ascending.shape[1] - torch.searchsorted(ascending, target_logits, right=True).squeeze(1)
    return logprobs, above + 1


def stable_top_ids(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The defined top-k order: descending logit, equal logits by ascending token id (a stable sort)."""
    return torch.sort(-logits.float(), dim=-1, stable=True).indices[:, :k]


def make_logits(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(7, 1000, generator=g)
    logits[2, :300] = float("-inf")  # masked vocabulary covering whole leading chunks
    logits[3, 10:20] = logits[3, 5]  # ties with the target
    logits[5, [900, 59, 452, 3, 600, 7]] = 20.0  # a tie at the top that crosses the k-th place (k=5)
    logits = logits.to(dtype)
    targets = torch.randint(0, 1000, (7,), generator=g)
    targets[1] = logits[1].float().argmax()
    targets[2] = 999
    targets[3] = 5
    return logits, targets


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k", [0, 5])
def test_token_logprobs_matches_reference(dtype: torch.dtype, k: int) -> None:
    logits, targets = make_logits(dtype)
    ref_lp, ref_rank, ref_ids, ref_top = token_logprobs_torch(logits, targets, k)
    ind_lp, ind_rank = independent_reference(logits, targets)
    torch.testing.assert_close(ref_lp.double(), ind_lp, rtol=0, atol=1e-5)
    assert torch.equal(ref_rank, ind_rank)
    assert ref_rank[1] == 1 and ref_rank[3] == int((logits[3] > logits[3, 5]).sum()) + 1
    assert torch.equal(ref_ids, stable_top_ids(logits, k))  # ties in id order, whatever torch.topk does
    if k:
        assert ref_ids[5].tolist() == [3, 7, 59, 452, 600]

    wide = torch.cat([logits, torch.zeros(7, 24, dtype=dtype)], dim=1).to(DEVICE)  # strided rows
    lp, rank, ids, top = token_logprobs(wide[:, :1000], targets.to(DEVICE), k, block_v=128)
    assert lp.dtype == top.dtype == torch.float32 and rank.dtype == ids.dtype == torch.int64
    assert ids.shape == top.shape == (7, k)
    torch.testing.assert_close(lp.cpu(), ref_lp, rtol=0, atol=1e-5)
    assert torch.equal(rank.cpu(), ref_rank)
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(top.cpu(), ref_top, rtol=0, atol=1e-5)
    if k:
        assert torch.all(top[:, :-1] >= top[:, 1:])  # sorted descending


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # (the all -inf row: log(0), -inf - -inf)
def test_fused_top_k_is_bitwise_the_torch_topk_path(dtype: torch.dtype) -> None:
    """The top-k kept in the kernel's pass (k <= FUSED_TOP_K_MAX) and torch.topk's (a larger k, or
    fused_top_k_max=0) give the same bits: a batch's largest k, which picks the path, cannot reach a record.
    Cases: ties at the top and across the k-th place, many ties everywhere, masked (-inf) leading chunks, an
    all -inf row (its ids are the first k, its logprobs NaN), a chunk boundary inside a tie."""
    logits, targets = make_logits(dtype)
    g = torch.Generator().manual_seed(1)
    ties = torch.randint(0, 4, (3, 1000), generator=g).to(dtype)  # many ties everywhere
    logits = torch.cat([logits, ties, torch.full((1, 1000), float("-inf"), dtype=dtype)])
    logits[-5, 120:136] = 30.0  # a tie of 16 at the top across the chunk boundary at 128
    targets = torch.cat([targets, torch.randint(0, 1000, (4,), generator=g)]).to(DEVICE)
    logits = logits.to(DEVICE)
    for k in (1, 5, 20):
        fused = token_logprobs(logits, targets, k, block_v=128)
        library = token_logprobs(logits, targets, k, block_v=128, fused_top_k_max=0)
        assert torch.equal(fused[2], library[2]), k
        assert torch.equal(fused[3].isnan(), library[3].isnan()) and fused[3][-1].isnan().all()
        finite = ~library[3].isnan()
        assert torch.equal(fused[3][finite], library[3][finite]), k  # bitwise, not within a tolerance
        assert torch.equal(fused[2].cpu(), stable_top_ids(logits.cpu(), k)), k
    assert fused[2][-5, :16].tolist() == list(range(120, 136))  # the 16-way tie in id order, across chunks


def with_scratch(logits, targets, k):
    """token_logprobs_torch on the CPU path that reuses buffers (ranks counted in an fp32 buffer)."""
    return token_logprobs_torch(logits, targets, k, reuse_buffers=True)


def test_token_logprob_ranks_with_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, -1.0]] * 4)
    targets = torch.tensor([1, 4, 3, 5])
    want = torch.tensor([1, 1, 4, 6])  # 1 + entries strictly greater: ties share the better rank
    for fn in (token_logprobs_torch, token_logprobs, with_scratch):
        _, ranks, ids, _ = fn(logits.to(DEVICE), targets.to(DEVICE), 3)
        assert torch.equal(ranks.cpu(), want), fn.__name__
        assert set(ids[0].tolist()) == {1, 2, 4}


def test_token_logprobs_out_of_range_target() -> None:
    logits = torch.randn(3, 50)
    targets = torch.tensor([0, -1, 50])
    for fn in (token_logprobs_torch, token_logprobs, with_scratch):
        lp, ranks, _, _ = fn(logits.to(DEVICE), targets.to(DEVICE), 2)
        assert torch.isfinite(lp[0]) and torch.isnan(lp[1:]).all(), fn.__name__
        assert ranks[1:].tolist() == [0, 0]


# ---------------------------------------------------------------------------------------------------------
# Wrapper checks: clear ValueErrors before any launch

def test_wrappers_reject_bad_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = random_batch([(2, 3)], num_kv_heads=2, group=2, head_dim=16, block_size=4)
    with pytest.raises(ValueError, match="num_kv_heads, head_dim"):
        store_kv(batch.key[:, :1], batch.value[:, :1], batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    with pytest.raises(ValueError, match="slot_mapping must have dtype"):
        store_kv(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping.float())
    with pytest.raises(ValueError, match="must match"):
        paged_attention(batch.query.half(), batch.k_cache, batch.v_cache, *kernel_meta(batch.meta))
    with pytest.raises(ValueError, match="last dimension of query must be contiguous"):
        paged_attention(batch.query.transpose(1, 2).contiguous().transpose(1, 2), batch.k_cache, batch.v_cache,
                        *kernel_meta(batch.meta))
    with pytest.raises(ValueError, match="not a multiple"):
        paged_attention(batch.query[:, :3], batch.k_cache[:, :, :2], batch.v_cache[:, :, :2], *kernel_meta(batch.meta))
    with pytest.raises(ValueError, match="weight has 7 entries"):
        rms_norm(torch.randn(2, 8, device=DEVICE), torch.ones(7, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="k must be an int"):
        token_logprobs(torch.randn(2, 8, device=DEVICE), torch.zeros(2, dtype=torch.int64, device=DEVICE), 9)
    with pytest.raises(ValueError, match="int64 targets"):
        token_logprobs_torch(torch.randn(2, 8), torch.zeros(2, dtype=torch.int32), 1)
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            rms_norm(torch.randn(2, 8), torch.ones(8), 1e-5)


# ---------------------------------------------------------------------------------------------------------
# The GPU build: the interpreter runs the kernels as Python, so it cannot catch what only the compiler rejects
# (loop-carried types, constexpr misuse, tl.dot shapes), nor a configuration whose pipelined tiles overflow
# Hopper's shared memory (a launch would fail with OutOfResources). Compile them ahead of time for sm_90
# (Hopper), down to a cubin with Triton's bundled ptxas; no GPU needed. Pointers and the integers named
# `aligned` are marked divisible by 16, as a launch with the engine's tensors specialises them: without that,
# Triton neither pipelines the loads (num_stages) nor sizes shared memory as the GPU run will.

AOT_SCRIPT = textwrap.dedent("""
    import importlib
    import sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    SM90_SHARED = 232448  # bytes of shared memory one block may opt in to on sm_90 (227 KB)

    def build(module, kernel, ptrs, floats, consts, num_warps, num_stages=3, aligned=(), fp_fusion=True):
        # ptrs: the dtype of each pointer, or the "tensordesc<dtype[block]>" type of each tensor descriptor
        fn = getattr(importlib.import_module("apcscore.kernels." + module), kernel)
        sig = {a: "constexpr" if a in consts else "*" + ptrs[a] if a.endswith("_ptr") else ptrs[a] if
               a.endswith("_desc") else "fp32" if a in floats else "i32" for a in fn.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
                 if a.endswith("_ptr") or a in aligned}
        out = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": num_warps, "num_stages": num_stages,
                                      "enable_fp_fusion": fp_fusion})
        assert out.asm["cubin"], kernel
        assert out.metadata.shared <= SM90_SHARED, (kernel, consts, num_stages, out.metadata.shared)
        print("compiled", module, consts, num_warps, num_stages, out.metadata.shared)
        return out

    pa = importlib.import_module("apcscore.kernels.paged_attention")
    # causal (the three dtypes), then Gemma's sliding window and soft-cap (bf16, head_dim 256 like Gemma 2/3)
    for dt, head_dim, group, masks in (("bf16", 64, 3, False), ("fp16", 128, 4, False), ("fp32", 48, 1, False),
                                       ("bf16", 256, 2, True)):
        block_m, block_n, warps = pa.tile_config(head_dim, group)
        ptrs = dict(out_ptr=dt, q_ptr=dt, k_cache_ptr=dt, v_cache_ptr=dt, block_tables_ptr="i32",
                    cu_seqlens_q_ptr="i32", seq_lens_ptr="i32", skip_ptr="i32", groups_ptr="i32")
        tiles = dict(BLOCK_SIZE=16, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), GROUP=group,
                     BLOCK_M=block_m, BLOCK_Q=block_m // group, BLOCK_N=block_n, IEEE_DOT=dt == "fp32",
                     SOFTCAP=masks)
        build("paged_attention", "_paged_attention_kernel", ptrs, {"scale_log2", "softcap_log2"},
              dict(tiles, WINDOW=masks, SKIP=not masks), warps)
        # the shared-prefix decode groups' kernel, with the same tiles (windowed layers never group)
        build("paged_decode_shared", "_shared_prefix_decode_kernel", ptrs, {"scale_log2", "softcap_log2"}, tiles,
              warps)
    build("store_kv", "_store_kv_kernel", dict(key_ptr="fp32", value_ptr="fp32", k_cache_ptr="bf16",
          v_cache_ptr="bf16", slot_mapping_ptr="i64"), set(),
          dict(NUM_KV_HEADS=3, HEAD_DIM=64, BLOCK_H=4, BLOCK_D=64), 4)
    build("rmsnorm", "_rms_norm_kernel", dict(out_ptr="fp32", res_out_ptr="bf16", x_ptr="bf16", res_ptr="bf16",
          w_ptr="fp32"), {"eps"}, dict(HAS_RESIDUAL=True, BLOCK=1024), 4)
    build("logprobs", "_token_logprobs_kernel", dict(logits_ptr="fp32", targets_ptr="i64", lse_ptr="fp32",
          logprobs_ptr="fp32", ranks_ptr="i64", top_ids_ptr="i64", top_lp_ptr="fp32"), set(),
          dict(BLOCK_V=4096, K_PAD=64), 8)
    for dt, bf16 in (("bf16", True), ("fp32", False)):  # rotary: fp-contraction off, as its wrapper launches it
        ptrs = dict(q_ptr=dt, k_ptr=dt, cos_ptr=dt, sin_ptr=dt, q_out_ptr=dt, k_out_ptr=dt)
        build("rotary", "_rotary_kernel", ptrs, set(), dict(HALF=32, BLOCK_H=4, BLOCK_D=32, IS_BF16=bf16), 4,
              fp_fusion=False)

    # every linear layer on CUDA: the table's default in the engine's dtypes (and the LM head's fp32 logits from
    # bf16), and each candidate of the GPU check's sweep in bf16 (one that cannot launch costs the sweep its row)
    sys.path.insert(0, "scripts")
    from gpu_check_sweep import candidates
    from apcscore.kernels.matmul_configs import DEFAULT
    configs = [("bf16", "bf16", DEFAULT), ("bf16", "fp32", DEFAULT), ("fp16", "fp16", DEFAULT),
               ("fp32", "fp32", DEFAULT)]
    configs += [("bf16", "bf16", cfg) for name, cfg in candidates().items() if name != "default"]
    for dt, out_dt, cfg in configs:
        consts = dict(IEEE=dt == "fp32", BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                      GROUP_M=cfg.group_m)
        if cfg.tma_persistent:  # tensor descriptors of the tiles; 132 programs, the H200's SMs
            bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
            descs = dict(x_desc=f"tensordesc<{dt}[{bm}, {bk}]>", w_desc=f"tensordesc<{dt}[{bn}, {bk}]>",
                         y_desc=f"tensordesc<{out_dt}[{bm}, {bn}]>")
            out = build("matmul", "_linear_tma_persistent_kernel", descs, set(), dict(consts, NUM_PROGRAMS=132),
                        cfg.num_warps, cfg.num_stages, aligned=("N", "K"))
            assert "cp.async.bulk.tensor" in out.asm["ptx"], ("no TMA copy in", cfg)  # what the variant is for
        else:
            build("matmul", "_linear_kernel", dict(x_ptr=dt, w_ptr=dt, y_ptr=out_dt), set(), consts,
                  cfg.num_warps, cfg.num_stages, aligned=("N", "K", "stride_xm", "stride_wn", "stride_ym"))
""")


@pytest.mark.slow
def test_kernels_compile_for_hopper(tmp_path: Path) -> None:
    import triton

    sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
    from gpu_check_sweep import candidates

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton build has no bundled ptxas (CUDA backend) to compile with")
    if HAS_CUDA:  # the GPU check's tests part: its minutes are scarce, and there everything compiles for real
        pytest.skip("a GPU is here: the kernels are compiled and launched by the other tests and the sweep")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    result = subprocess.run([sys.executable, "-c", AOT_SCRIPT], env=env, capture_output=True, text=True,
                            timeout=120, cwd=Path(__file__).parents[2])
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("compiled") == 13 + 4 + len(candidates()) - 1, result.stdout


def test_buffered_rank_counts_refuse_a_vocabulary_fp32_cannot_count() -> None:
    """Counts summed in fp32 are exact only below 2^24 entries: a bigger vocabulary is refused, not miscounted."""
    logits = torch.zeros(1, 2 ** 24)
    with pytest.raises(ValueError, match="2\\^24"):
        token_logprobs_torch(logits, torch.tensor([0]), 0, reuse_buffers=True)
