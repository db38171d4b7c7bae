"""Copying a Hugging Face state dict into a decoder's parameters, by name, with every weight accounted for."""

from __future__ import annotations

from typing import Mapping

import torch

from apcscore.errors import ApcscoreError


class WeightCopier:
    """copier(param, *names): fills `param`'s rows with the named checkpoint tensors in order (fused q/k/v or
    gate/up parameters take several), checking shapes; `check_all_used` then refuses a checkpoint with
    weights nothing took.

    Each source may sit on any device in any dtype: `copy_` converts while writing into the parameter, so peak
    device memory is the parameters plus nothing. consume=True removes each entry from `state` once copied (a
    caller that owns a big CPU dict frees it as it goes); by default `state` is left as it was.
    """

    def __init__(self, state: Mapping[str, torch.Tensor], consume: bool = False) -> None:
        self.state = state
        self.consume = consume
        self.used: set[str] = set()

    def take(self, name: str) -> torch.Tensor:
        """The checkpoint tensor `name`, marked used."""
        if name not in self.state:
            raise ApcscoreError(f"weight {name} is missing from the checkpoint")
        self.used.add(name)
        return self.state.pop(name) if self.consume else self.state[name]  # type: ignore[attr-defined]

    def __call__(self, param: torch.Tensor, *names: str) -> None:
        sources = [self.take(n) for n in names]
        shape = (sum(s.shape[0] for s in sources), *sources[0].shape[1:])
        if any(s.shape[1:] != sources[0].shape[1:] for s in sources) or shape != tuple(param.shape):
            raise ApcscoreError(f"weight {names[0]} has shape {tuple(sources[0].shape)}, expected "
                                f"{tuple(param.shape)}")
        row = 0
        for src in sources:  # fused parameters: each source fills its own rows, no concatenated copy
            param[row:row + src.shape[0]].copy_(src)
            row += src.shape[0]

    def check_all_used(self, optional: tuple[str, ...] = ("lm_head.weight",),
                       ignored_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)) -> None:
        """Refuse weights nothing took, except `optional` names (a tied checkpoint may still carry its LM head)
        and buffers ending in `ignored_suffixes`."""
        unused = {n for n in set(self.state) - self.used - set(optional) if not n.endswith(ignored_suffixes)}
        if unused:
            raise ApcscoreError(f"checkpoint has weights this model does not use: {sorted(unused)[:5]}")
