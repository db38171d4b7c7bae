"""Engine configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from apcscore.errors import ApcscoreError, shown

MAX_LOGPROBS_DEFAULT = 20


@dataclass(frozen=True)
class EngineConfig:
    """Settings of the batch engine. Every field has a CLI option of the same name (dashes for underscores) on
    score, generate and perplexity (`seed` on generate only), and a key of the same name in a `--config` file;
    the two switches that default to on are turned off with --no-prefix-caching and --no-cuda-graphs."""

    device: str = "auto"  # auto | cpu | cuda (auto = cuda if available)
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto = float32 on CPU, bfloat16 on CUDA)
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # None = derived from available memory
    max_batch_tokens: int = 2048  # token budget of one engine step (prefill chunks + decodes)
    max_num_seqs: int = 64  # sequences running at once
    enable_prefix_caching: bool = True
    max_logprobs: int = MAX_LOGPROBS_DEFAULT  # cap on --prompt-logprobs / --logprobs
    logprobs_chunk_size: int = 1024  # rows of the vocabulary projection computed at once
    attention_backend: str = "auto"  # auto | torch | triton (auto = triton on CUDA, torch elsewhere)
    # share of memory for the KV pool when num_kv_blocks is None (None: 0.25 of free host memory, at most
    # 4 GiB, on CPU; on CUDA 0.85 of the card's total, minus the peak of a profile run of the largest step)
    kv_cache_memory_fraction: float | None = None
    seed: int = 0  # base seed for requests that do not set their own
    max_model_len: int | None = None  # None = the model's context length
    use_cuda_graphs: bool = True  # decode steps on CUDA replay captured graphs
    # a record's results do not depend on what shares its steps (docs/architecture.md); False trades it for speed
    batch_invariant: bool = True
    # auto | native | transformers: our decoder (paged KV, prefix cache, batch invariance) or the model's own
    # transformers forward and generate() (full recompute, no cache); auto = native where it implements the
    # architecture, else transformers (apcscore.models.architecture.choose_model_backend)
    model_backend: str = "auto"
    # scoring requests read cached KV of the blocks before their first scored position (needs batch_invariant:
    # then the results are bitwise those of a full recompute, docs/architecture.md "Exact reuse")
    exact_reuse: bool = False

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ApcscoreError(msg)

        for f in fields(self):  # types first, so that the range checks below cannot raise TypeError
            value, kinds = getattr(self, f.name), _KINDS[f.name]
            need((value is None and type(None) in kinds) or
                 (isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)),
                 f"--{f.name.replace('_', '-')} must be {_WHAT[kinds]}, not {shown(value)}")

        need(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"),
             f"--device must be auto, cpu or cuda, not {self.device!r}")
        need(self.dtype in ("auto", "float32", "bfloat16", "float16"),
             f"--dtype must be auto, float32, bfloat16 or float16, not {self.dtype!r}")
        need(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
             f"--block-size must be a power of two, not {self.block_size}")
        need(self.num_kv_blocks is None or self.num_kv_blocks >= 1,
             f"--num-kv-blocks must be at least 1, not {self.num_kv_blocks}")
        need(self.max_batch_tokens >= 1, f"--max-batch-tokens must be at least 1, not {self.max_batch_tokens}")
        need(self.max_num_seqs >= 1, f"--max-num-seqs must be at least 1, not {self.max_num_seqs}")
        need(self.max_logprobs >= 0, f"--max-logprobs must be >= 0, not {self.max_logprobs}")
        need(self.logprobs_chunk_size >= 1, "logprobs_chunk_size must be at least 1")
        need(self.attention_backend in ("auto", "torch", "triton"),
             f"--attention-backend must be auto, torch or triton, not {self.attention_backend!r}")
        need(self.model_backend in ("auto", "native", "transformers"),
             f"--model-backend must be auto, native or transformers, not {self.model_backend!r}")
        need(self.kv_cache_memory_fraction is None or 0 < self.kv_cache_memory_fraction <= 0.95,
             "kv_cache_memory_fraction must be in (0, 0.95]")
        need(not self.exact_reuse or self.batch_invariant,
             "--exact-reuse needs batch invariance: without it a cached block's KV is not bitwise what a fresh "
             "prefill writes, so reused scores could differ from a full recompute — drop --no-batch-invariant "
             "(or --exact-reuse)")
        need(not self.exact_reuse or self.enable_prefix_caching,
             "--exact-reuse reads the prefix cache, which --no-prefix-caching turns off — drop one of the two")

    def check_logprobs(self, k: int | None, option: str) -> None:
        """Refuse a top-K request above `max_logprobs` with a message that says how to raise the cap."""
        if k is None:
            return
        if k < 0:
            raise ApcscoreError(f"{option} must be >= 0, not {k}")
        if k > self.max_logprobs:
            raise ApcscoreError(
                f"{option} {k} is above the cap max_logprobs = {self.max_logprobs}; "
                f"ask for at most {self.max_logprobs}, or raise the cap with --max-logprobs {k}"
            )

    def to_dict(self) -> dict:
        return asdict(self)


_KINDS: dict[str, tuple[type, ...]] = {
    "device": (str,), "dtype": (str,), "attention_backend": (str,), "model_backend": (str,),
    "block_size": (int,), "max_batch_tokens": (int,), "max_num_seqs": (int,), "max_logprobs": (int,),
    "logprobs_chunk_size": (int,), "seed": (int,),
    "num_kv_blocks": (int, type(None)), "max_model_len": (int, type(None)),
    "enable_prefix_caching": (bool,), "use_cuda_graphs": (bool,), "batch_invariant": (bool,), "exact_reuse": (bool,),
    "kv_cache_memory_fraction": (int, float, type(None)),
}
_WHAT = {(str,): "a string", (int,): "an integer", (int, type(None)): "an integer or unset",
         (bool,): "true or false", (int, float, type(None)): "a number or unset"}
