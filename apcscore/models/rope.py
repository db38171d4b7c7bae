"""Rotary embedding frequencies and cos/sin tables as transformers computes them for a config (every rope type it
knows; Phi-3's long-rope through `longrope_frequencies`), with portable transcendental functions.

transformers' arithmetic is kept, but its pow, exp, log, cos and sin (torch's, whose bits follow the CPU's vector
width: SLEEF on AVX2/AVX-512, libm in scalar code) and the `math.log` of its scaling factors (libm's) run as
apcscore's own double-precision functions (apcscore.kernels.cpu_math), rounded once to the tensor's dtype
(`portable_math`). So the tables, computed once per model on the CPU, have the same bits on every machine, and
are at least as accurate as transformers' fp32 ones (within 1 ulp of them; docs/architecture.md, "Portable bits").
"""

from __future__ import annotations

import contextlib
import math
import types
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode


# Rotary inverse frequencies [head_dim / 2] (fp32) and the cos/sin scale: the pair transformers' rope init functions
# (`ROPE_INIT_FUNCTIONS[rope_type]`) return, as (inv_freq, attention_factor).
Rope = tuple[torch.Tensor, float]


class _PortableMathMode(TorchFunctionMode):
    """Routes torch's pow, exp, log, cos and sin of CPU float tensors to apcscore's double functions."""

    def __torch_function__(self, func: Callable, types_: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        from apcscore.kernels import cpu_math

        kwargs = kwargs or {}
        unary = {torch.cos: cpu_math.D_COS, torch.Tensor.cos: cpu_math.D_COS, torch.sin: cpu_math.D_SIN,
                 torch.Tensor.sin: cpu_math.D_SIN, torch.exp: cpu_math.D_EXP, torch.Tensor.exp: cpu_math.D_EXP,
                 torch.log: cpu_math.D_LOG, torch.Tensor.log: cpu_math.D_LOG}
        if func in unary and not kwargs and len(args) == 1 and _float_cpu(args[0]):
            return cpu_math.map_double(unary[func], args[0]).to(args[0].dtype)
        if func in (torch.pow, torch.Tensor.pow, torch.Tensor.__pow__, torch.Tensor.__rpow__) and not kwargs:
            base, exponent = (args[1], args[0]) if func is torch.Tensor.__rpow__ else args
            result = _portable_pow(base, exponent)
            if result is not None:
                return result
        return func(*args, **kwargs)


def _float_cpu(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.device.type == "cpu"


def _portable_pow(base: Any, exponent: Any) -> torch.Tensor | None:
    """base ** exponent as exp(exponent * log(base)) in double, rounded once to torch's result dtype; None where
    that does not apply (a non-float or non-CPU operand, an integral power, a base <= 0: torch's own then)."""
    from apcscore.kernels import cpu_math

    if not (_float_cpu(base) or _float_cpu(exponent)):
        return None
    if any(isinstance(v, torch.Tensor) and v.device.type != "cpu" for v in (base, exponent)):
        return None
    if isinstance(exponent, (int, float)) and float(exponent).is_integer():
        return None  # x ** 2 etc.: torch multiplies (exact)
    dtype = torch.result_type(base, exponent)
    if not dtype.is_floating_point:
        return None
    b = torch.as_tensor(base, dtype=torch.float64)
    if not bool((b > 0).all()):
        return None
    e = torch.as_tensor(exponent, dtype=torch.float64)
    log_b = cpu_math.map_double(cpu_math.D_LOG, b)
    return cpu_math.map_double(cpu_math.D_EXP, e * log_b).to(dtype)


def _math_module() -> types.SimpleNamespace:
    """Python's math with our log (libm's log is not correctly rounded, and its x86 build picks an FMA variant by
    CPU); sqrt, floor, ceil and the constants are exact already."""
    from apcscore.kernels.rowmath import log_scalar

    names = {name: getattr(math, name) for name in dir(math) if not name.startswith("_")}
    names["log"] = lambda x, base=None: log_scalar(x) if base is None else log_scalar(x) / log_scalar(base)
    return types.SimpleNamespace(**names)


@contextlib.contextmanager
def portable_math() -> Iterator[None]:
    """Inside (or in a function decorated `@portable_math()`): transformers' rope code computes with portable
    pow/exp/log/cos/sin (see the module doc). A no-op where the C library cannot be built (the run metadata then
    says the bits are not portable)."""
    from apcscore.kernels.rowmath import portable

    if not portable():
        yield
        return
    import transformers.modeling_rope_utils as rope_utils

    saved = rope_utils.math
    rope_utils.math = _math_module()
    try:
        with _PortableMathMode():
            yield
    finally:
        rope_utils.math = saved


@portable_math()
def rope_frequencies(config: Any) -> Rope | None:
    """transformers' rotary frequencies for config; None for rope types that change with sequence length."""
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if "dynamic" in rope_type or rope_type == "longrope":
        return None
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    with torch.device("cpu"):
        rotary = LlamaRotaryEmbedding(config)
    return rotary.inv_freq.float().clone(), float(rotary.attention_scaling)


@portable_math()
def longrope_frequencies(config: Any) -> tuple[Rope, Rope]:
    """Long-rope (Phi-3): the (short, long) frequencies transformers' rotary embedding switches between.

    transformers computes both with its own `ROPE_INIT_FUNCTIONS["longrope"]`: short as the module's initial
    buffer (no sequence length), long with seq_len original_max_position_embeddings + 1
    (`dynamic_rope_update`'s longrope_frequency_update). The cos/sin scale is the one of the initial call (the
    forward never changes it); it depends only on the config, so both share it.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init = ROPE_INIT_FUNCTIONS["longrope"]
    original_max = int(config.rope_parameters["original_max_position_embeddings"])
    with torch.device("cpu"):
        short, scaling = init(config)
        long, _ = init(config, None, seq_len=original_max + 1)
    return (short.float().clone(), float(scaling)), (long.float().clone(), float(scaling))


@portable_math()
def rotary_tables(rope: Rope, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [num_positions, 2 * len(inv_freq)] fp32 for positions 0 .. num_positions - 1, with the arithmetic of
    transformers' rotary embedding forward (LlamaRotaryEmbedding, Phi3RotaryEmbedding)."""
    inv_freq, attention_scaling = rope
    positions = torch.arange(num_positions)
    freqs = positions[:, None].float() * inv_freq.float()  # [P, D / 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
    return emb.cos() * attention_scaling, emb.sin() * attention_scaling
