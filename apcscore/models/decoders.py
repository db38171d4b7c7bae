"""Which of our decoder classes runs a natively supported architecture (apcscore.models.architecture)."""

from __future__ import annotations

from typing import Any

from apcscore.models.architecture import SUPPORTED_ARCHITECTURES, check_architecture
from apcscore.models.gemma import GemmaDecoder
from apcscore.models.gpt_neox import GPTNeoXDecoder
from apcscore.models.llama import LlamaDecoder
from apcscore.models.moe import MoeDecoder
from apcscore.models.olmo2 import Olmo2Decoder
from apcscore.models.phi3 import Phi3Decoder

CLASSES: dict[str, type[LlamaDecoder]] = {"gpt_neox": GPTNeoXDecoder, "olmo2": Olmo2Decoder,
                                       "phi3": Phi3Decoder, "mixtral": MoeDecoder,
                                       "qwen2_moe": MoeDecoder, "gemma2": GemmaDecoder,
                                       "gemma3": GemmaDecoder}  # else LlamaDecoder


def decoder_class(hf_config: Any) -> type[LlamaDecoder]:
    """The decoder class of hf_config's architecture (an ApcscoreError when none is native)."""
    family = SUPPORTED_ARCHITECTURES[check_architecture(hf_config)]
    return CLASSES.get(family, LlamaDecoder)


def build_decoder(hf_config: Any, ops: Any, max_positions: int, device: Any, dtype: Any, state: Any,
                  rope: Any = None, consume: bool = False, tp: Any = None) -> LlamaDecoder:
    """The decoder of hf_config on `device` in `dtype`, its weights copied from `state` (a state dict, or a
    models.loading.LazyCheckpoint), in eval mode. tp: a models.tensor_parallel.TensorParallel to build that rank's
    slice (None: the whole model)."""
    model = decoder_class(hf_config)(hf_config, ops, max_positions=max_positions, device="meta")
    if tp is not None:
        from apcscore.models.tensor_parallel import slice_decoder

        slice_decoder(model, tp)
    model = model.materialize(device, dtype)
    model.load_hf_weights(state, rope, consume=consume)
    model.eval()
    return model
