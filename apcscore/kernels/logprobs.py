"""Per-token logprobs over the vocabulary: a fused Triton kernel with the results of its torch reference off the
CPU, logprobs_torch.token_logprobs_torch (that module's doc: the logprob under an fp32 log_softmax, the rank, the
order of the top-k; a target outside [0, V) gives logprob NaN and rank 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from apcscore.kernels._checks import check_dtype, check_float_input, check_shape, check_tensors
from apcscore.kernels.logprobs_torch import top_k

BLOCK_V = 4096  # vocabulary entries per chunk of the kernel's loop (untuned)
NUM_WARPS = 8
# Top-k up to this k is kept in the kernel's pass over the vocabulary (a running set of k slots); a larger k takes
# logprobs_torch.top_k (torch.topk). Both give the same ids and values (one defined order, the logits themselves),
# so which one ran for a batch (k is the largest any of its requests asks for) does not reach a record's bits.
# The kernel is compiled once for every k (K_PAD is always this, k is a runtime argument it is not specialised
# on): the log-sum-exp, logprob and rank of a row come from one binary whatever its batch asks for.
# torch.topk took more of a score than attention did (docs/benchmarks.md, runs 3 and 4).
FUSED_TOP_K_MAX = 64
INT32_MAX = 2 ** 31 - 1
_NO_ID = tl.constexpr(INT32_MAX)  # in the kernel: "no entry", above every token id and empty slot


@triton.jit(do_not_specialize=["k"])
def _token_logprobs_kernel(logits_ptr, targets_ptr, lse_ptr, logprobs_ptr, ranks_ptr, top_ids_ptr, top_lp_ptr,
                           stride_row, vocab, k, BLOCK_V: tl.constexpr, K_PAD: tl.constexpr):
    """One program per row: online log-sum-exp over vocabulary chunks, the target's logit and its rank, and the
    top k (k <= K_PAD; none for k = 0) in the same pass.

    Top-k: k slots hold the best entries so far under the order (logit descending, token id ascending). A chunk's
    best available entry replaces the slots' worst while it beats it; chunks come in id order, so an entry that
    only ties the worst (a higher id) never does. Empty slots start at (-inf, id vocab + slot): any real entry,
    even one of -inf, beats them. At the end the slots are written out in that order."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    target = tl.load(targets_ptr + row).to(tl.int64)
    target_ok = (target >= 0) & (target < vocab)
    target_logit = tl.load(base + target, mask=target_ok, other=0.0).to(tl.float32)
    m = tl.full([], float("-inf"), tl.float32)  # running max
    s = tl.zeros([], tl.float32)  # running sum of exp(x - m)
    greater = tl.zeros([], tl.int32)  # entries with a logit strictly above the target's
    slots = tl.arange(0, K_PAD)
    slot_ok = slots < k  # [K_PAD] the k slots in use
    top_v = tl.full([K_PAD], float("-inf"), tl.float32)  # [K_PAD] the slots' logits
    top_i = vocab + slots  # [K_PAD] int32 the slots' token ids (empty: vocab + slot)
    worst_v = tl.min(tl.where(slot_ok, top_v, float("inf")), 0)  # the worst slot in use (k = 0: none, +inf)
    worst_i = tl.max(tl.where(slot_ok & (top_v == worst_v), top_i, -1), 0)
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        in_vocab = cols < vocab
        x = tl.load(base + cols, mask=in_vocab, other=float("-inf")).to(tl.float32)  # [BLOCK_V]
        m_new = tl.maximum(m, tl.max(x, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: avoid -inf - -inf
        s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(x - m_ref), 0)
        m = m_new
        greater += tl.sum((x > target_logit).to(tl.int32), 0)
        # top-k: the chunk's best available entry replaces the worst slot while it beats it
        avail = in_vocab  # [BLOCK_V] entries not yet taken into a slot
        best_v = tl.max(tl.where(avail, x, float("-inf")), 0)
        best_i = tl.min(tl.where(avail & (x == best_v), cols, _NO_ID), 0)
        while (best_v > worst_v) | ((best_v == worst_v) & (best_i < worst_i)):
            replace = top_i == worst_i  # [K_PAD] the worst slot (ids are unique)
            top_v = tl.where(replace, best_v, top_v)
            top_i = tl.where(replace, best_i, top_i)
            avail = avail & (cols != best_i)
            worst_v = tl.min(tl.where(slot_ok, top_v, float("inf")), 0)
            worst_i = tl.max(tl.where(slot_ok & (top_v == worst_v), top_i, -1), 0)
            best_v = tl.max(tl.where(avail, x, float("-inf")), 0)
            best_i = tl.min(tl.where(avail & (x == best_v), cols, _NO_ID), 0)
    lse = m + tl.log(s)
    tl.store(lse_ptr + row, lse)
    tl.store(logprobs_ptr + row, tl.where(target_ok, target_logit - lse, float("nan")))
    tl.store(ranks_ptr + row, tl.where(target_ok, greater.to(tl.int64) + 1, 0))
    left = slot_ok  # [K_PAD] slots not yet written
    for j in range(0, k):
        v = tl.max(tl.where(left, top_v, float("-inf")), 0)
        i = tl.min(tl.where(left & (top_v == v), top_i, _NO_ID), 0)
        left = left & (top_i != i)
        tl.store(top_ids_ptr + row * k + j, i.to(tl.int64))
        tl.store(top_lp_ptr + row * k + j, v - lse)  # as top_k's logits.float() - lse: the same fp32 op


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int, ranks: bool = True, *,
                   block_v: int = BLOCK_V, fused_top_k_max: int = FUSED_TOP_K_MAX
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused logprobs of the target tokens, without materialising an [N, V] fp32 tensor.

    logits: [N, V] fp32/fp16/bf16 (rows may be strided, V contiguous); targets: [N] int64; k >= 0.
    Returns logprobs [N] f32, ranks [N] int64, top_ids [N, k] int64, top_logprobs [N, k] f32.
    The kernel computes the fp32 log-sum-exp, the target's logprob and rank, and for k <= fused_top_k_max the
    top-k, in one pass over the vocabulary; a larger k uses logprobs_torch.top_k (torch.topk) on the input logits.
    Either way the top-k are ordered by descending logit, equal logits by ascending token id, and their logprobs
    are those logits in fp32 minus the kernel's log-sum-exp: the same bits (rows holding a NaN logit, whose
    logprobs are NaN, have no defined top-k order). block_v: vocabulary entries per chunk (a power of two).
    ranks is accepted for the torch reference's signature: the kernel counts them in the same pass anyway.
    """
    name = "token_logprobs"
    check_tensors(name, logits=logits, targets=targets)
    check_float_input(name, "logits", logits, 2)
    if logits.shape[1] == 0:
        raise ValueError(f"{name}: logits have an empty vocabulary dimension, shape {tuple(logits.shape)}")
    check_shape(name, "targets", targets, 1)
    check_dtype(name, "targets", targets, (torch.int64,))
    if targets.shape[0] != logits.shape[0]:
        raise ValueError(f"{name}: {targets.shape[0]} targets for {logits.shape[0]} rows of logits")
    if not isinstance(k, int) or not 0 <= k <= logits.shape[1]:
        raise ValueError(f"{name}: k must be an int in [0, vocab size {logits.shape[1]}], got {k!r}")
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"{name}: block_v must be a power of two >= 16, got {block_v}")
    num_rows, vocab = logits.shape
    if vocab + FUSED_TOP_K_MAX > INT32_MAX:
        raise ValueError(f"{name}: a vocabulary of {vocab} entries does not fit the kernel's int32 token ids")
    dev = logits.device
    lse = torch.empty(num_rows, dtype=torch.float32, device=dev)
    logprobs = torch.empty(num_rows, dtype=torch.float32, device=dev)
    ranks = torch.empty(num_rows, dtype=torch.int64, device=dev)
    if not 0 <= fused_top_k_max <= FUSED_TOP_K_MAX:
        raise ValueError(f"{name}: fused_top_k_max must lie in [0, {FUSED_TOP_K_MAX}], got {fused_top_k_max}")
    fused = k <= fused_top_k_max
    kernel_k = k if fused else 0  # top-k slots the kernel fills (0: torch.topk below)
    top_ids = torch.empty((num_rows, kernel_k), dtype=torch.int64, device=dev)
    top_logprobs = torch.empty((num_rows, kernel_k), dtype=torch.float32, device=dev)
    if num_rows > 0:
        _token_logprobs_kernel[(num_rows,)](logits, targets, lse, logprobs, ranks, top_ids, top_logprobs,
                                            logits.stride(0), vocab, kernel_k,
                                            BLOCK_V=min(block_v, triton.next_power_of_2(vocab)),
                                            K_PAD=FUSED_TOP_K_MAX, num_warps=NUM_WARPS)
    if not fused:
        top_values, top_ids = top_k(logits, k)
        top_logprobs = top_values.float() - lse[:, None]  # [N, k]
    return logprobs, ranks, top_ids, top_logprobs
