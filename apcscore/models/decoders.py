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
