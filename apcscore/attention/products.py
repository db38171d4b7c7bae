"""The attention products of the torch backend: a @ b.T with a reduction order fixed by construction on the CPU.

On the CPU every score (q . k over head_dim) and every weighted value (p . v over a key tile) is summed in the
GEMM's fixed order (apcscore.kernels.cpu_gemm, the construction of the linear layers: one fma chain per block
of 64 indices, so a head_dim of 64 or a key tile is one chain), and a query's bits cannot depend on how many
rows or keys share the call. Elsewhere (CUDA, where this backend is the Triton kernels' reference)
and where the kernel cannot be built, torch.matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from apcscore.kernels.cpu_gemm import fixed_order_bmm, paged_bmm
from apcscore.kernels.cpu_library import available


def fixed_order(device: torch.device) -> bool:
    """Whether the attention products on `device` are the fixed-order kernel: on the CPU, where it builds."""
    return device.type == "cpu" and available()


def products(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, K] @ b[..., N, K].T -> fp32 [..., M, N] (the same leading dims; `x.transpose(-1, -2)` as b for
    a @ x), in the module doc's order."""
    if not fixed_order(a.device):
        return a @ b.transpose(-1, -2)
    lead, m, n = a.shape[:-2], a.shape[-2], b.shape[-2]
    if len(lead) > 2:  # the kernel takes two batch dims: merge the first ones (a view where strides allow)
        a, b = a.reshape(-1, *a.shape[-3:]), b.reshape(-1, *b.shape[-3:])
    return fixed_order_bmm(a, b).view(*lead, m, n)


@dataclass
class PagedCache:
    """The keys (or values) of a decode step's sequences, read in place from the paged cache through their block
    tables by the fixed-order CPU kernel (apcscore.kernels.cpu_gemm.paged_bmm): what `gather` would copy out, in
    every layer, is never copied. Products with it have the bits of `products` on the gathered copy."""

    cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    tables: torch.Tensor  # [B, max_blocks] int32, contiguous
    seq_lens: torch.Tensor  # [B] int32: positions at or past a sequence's length read its position 0 (masked)
    first: int  # the position of key 0

    def scores(self, q: torch.Tensor, num_keys: int) -> torch.Tensor:
        """q [Hkv, B, M, D] (or [Hkv, M, D] for one sequence) @ keys[first, first + num_keys).T -> [..., M, L]."""
        one = q.dim() == 3
        out = paged_bmm(q.unsqueeze(1) if one else q, self.cache, self.tables, self.seq_lens, self.first, num_keys)
        return out.squeeze(1) if one else out

    def weighted(self, p: torch.Tensor) -> torch.Tensor:
        """p [Hkv, B, T, M, tile] (or [Hkv, T, M, tile]) @ the values of tile t -> [..., T, M, D]."""
        one = p.dim() == 4
        out = paged_bmm(p.unsqueeze(1) if one else p, self.cache, self.tables, self.seq_lens, self.first)
        return out.squeeze(1) if one else out
