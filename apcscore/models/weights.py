"""Copying a Hugging Face state dict into a decoder's parameters, by name, with every weight accounted for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from apcscore.errors import ApcscoreError


@dataclass(frozen=True)
class SliceSpec:
    """Which part of a full parameter one tensor-parallel rank holds (apcscore.models.tensor_parallel).

    The full parameter is the concatenation of its named checkpoint tensors along `dim` (q, k, v rows of a fused
    qkv_proj; one tensor for a row-parallel projection's columns), `full` entries long; the rank's parameter is
    the `ranges` (start, length) of it, in order, concatenated along `dim`."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    full: int


def param_slices(model: torch.nn.Module) -> dict[int, SliceSpec]:
    """id(parameter) -> SliceSpec of every parameter of `model` a tensor-parallel rank holds a part of: the
    modules' `weight_slice` (weight) and `bias_slice` (apcscore.models.tensor_parallel). Call it after materialize."""
    out: dict[int, SliceSpec] = {}
    for module in model.modules():
        rank_slice = getattr(module, "weight_slice", None)
        if isinstance(rank_slice, SliceSpec):
            out[id(module.weight)] = rank_slice
            bias_slice = getattr(module, "bias_slice", None)
            if isinstance(bias_slice, SliceSpec):
                out[id(module.bias)] = bias_slice
    return out


class WeightCopier:
    """copier(param, *names): fills `param`'s rows with the named checkpoint tensors in order (fused q/k/v or
    gate/up parameters take several), checking shapes; `check_all_used` then refuses a checkpoint with
    weights nothing took.

    Each source may sit on any device in any dtype: `copy_` converts while writing into the parameter, so peak
    device memory is the parameters plus nothing. consume=True removes each entry from `state` once copied (a
    caller that owns a big CPU dict frees it as it goes); by default `state` is left as it was.
    """

    def __init__(self, state: Mapping[str, torch.Tensor], consume: bool = False,
                 slices: Mapping[int, SliceSpec] | None = None) -> None:
        """slices: id(parameter) -> its SliceSpec, for the parameters a tensor-parallel rank holds a part of (the
        others are copied whole). A state that offers `lazy(name)` (models.loading.LazyCheckpoint) is read only
        in the slices a sliced parameter needs."""
        self.state = state
        self.consume = consume
        self.used: set[str] = set()
        self.slices = slices or {}

    def take(self, name: str) -> torch.Tensor:
        """The checkpoint tensor `name`, marked used."""
        if name not in self.state:
            raise ApcscoreError(f"weight {name} is missing from the checkpoint")
        self.used.add(name)
        return self.state.pop(name) if self.consume else self.state[name]  # type: ignore[attr-defined]

    def __call__(self, param: torch.Tensor, *names: str) -> None:
        spec = self.slices.get(id(param))
        if spec is not None:
            return self.copy_slice(param, spec, names)
        sources = [self.take(n) for n in names]
        shape = (sum(s.shape[0] for s in sources), *sources[0].shape[1:])
        if any(s.shape[1:] != sources[0].shape[1:] for s in sources) or shape != tuple(param.shape):
            raise ApcscoreError(f"weight {names[0]} has shape {tuple(sources[0].shape)}, expected "
                                f"{tuple(param.shape)}")
        row = 0
        for src in sources:  # fused parameters: each source fills its own rows, no concatenated copy
            param[row:row + src.shape[0]].copy_(src)
            row += src.shape[0]

    def copy_slice(self, param: torch.Tensor, spec: SliceSpec, names: tuple[str, ...]) -> None:
        """Fill `param` with the ranges `spec` names of the concatenation of `names` along spec.dim, reading
        only those slices (lazily where the state allows)."""
        lazy = getattr(self.state, "lazy", None)
        sources: list[Any] = []
        for n in names:
            if lazy is not None and n in self.state:
                self.used.add(n)
                sources.append(lazy(n))  # a safetensors slice: indexing reads only the rows or columns asked
            else:
                sources.append(self.take(n))
        shapes = [tuple(s.get_shape()) if hasattr(s, "get_shape") else tuple(s.shape) for s in sources]
        sizes = [shape[spec.dim] for shape in shapes]
        local = sum(length for _, length in spec.ranges)
        want = list(param.shape)
        want[spec.dim] = spec.full
        if sum(sizes) != spec.full or local != param.shape[spec.dim] or any(
                [d for i, d in enumerate(shape) if i != spec.dim] != [d for i, d in enumerate(want) if i != spec.dim]
                for shape in shapes):
            raise ApcscoreError(f"weight {names[0]} has shape {shapes[0]}, expected {tuple(want)} in all")
        at = 0  # where the next piece goes in param along spec.dim
        for start, length in spec.ranges:
            offset = 0  # of the current source in the concatenation
            for src, size in zip(sources, sizes):
                lo, hi = max(start, offset), min(start + length, offset + size)
                if lo < hi:
                    a, b = lo - offset, hi - offset
                    piece = src[(slice(None),) * spec.dim + (slice(a, b),)]
                    param.narrow(spec.dim, at, hi - lo).copy_(piece)
                    at += hi - lo
                offset += size

    def check_all_used(self, optional: tuple[str, ...] = ("lm_head.weight",),
                       ignored_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)) -> None:
        """Refuse weights nothing took, except `optional` names (a tied checkpoint may still carry its LM head)
        and buffers ending in `ignored_suffixes`."""
        unused = {n for n in set(self.state) - self.used - set(optional) if not n.endswith(ignored_suffixes)}
        if unused:
            raise ApcscoreError(f"checkpoint has weights this model does not use: {sorted(unused)[:5]}")
