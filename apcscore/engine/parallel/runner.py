"""One engine's part on one tensor-parallel rank (`RankSlice`: the model slice and its runner) and the runner that
drives a step across the ranks (`SliceRunner`).

On rank 0 the SliceRunner is the engine's model runner: before each collective part of a step it broadcasts the
call through the RankGroup (engine/parallel/ranks.py), so the workers' SliceRunners run the same forward
(the step's host inputs: StepInputs), the same vocabulary-parallel logprobs (rows, targets, K) or the same logits
gather (the sampling rows) in step with it. Hidden states are replicated after every row-parallel sum, so the
workers index their own copy by the row numbers rank 0 sends; only rank 0 keeps the results.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any

import torch

from apcscore.config import EngineConfig
from apcscore.engine.kv_cache import profile_peak_memory
from apcscore.engine.model_runner import ModelRunner
from apcscore.engine.step import StepInputs, TokenLogprobs
from apcscore.engine.parallel.logprobs import gathered_logits, parallel_token_logprobs
from apcscore.models.decoders import build_decoder
from apcscore.models.llama import LlamaDecoder
from apcscore.models.loading import LazyCheckpoint
from apcscore.models.ops import Ops, select_ops
from apcscore.engine.parallel.faults import failure_note, report_failure
from apcscore.models.tensor_parallel import RanksFailed, TensorParallel


def torchrun_env() -> tuple[int, int] | None:
    """(rank, world size) when this process was started by torchrun (or any launcher setting RANK and
    WORLD_SIZE > 1), else None."""
    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def rank_device(device_type: str, rank: int) -> torch.device:
    """The device of rank `rank`: the CPU, or cuda:LOCAL_RANK (cuda:rank when apcscore started the ranks)."""
    if device_type != "cuda":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", rank)) if torchrun_env() else rank
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


@dataclass(frozen=True)
class LoadArgs:
    """What every rank needs to build its slice: rank 0 broadcasts it."""

    hf_config: Any
    weights: str | dict[str, torch.Tensor]  # a model directory (each rank reads only its slices) or a state dict
    rope: Any
    max_positions: int
    config: EngineConfig
    dtype: torch.dtype
    device_type: str


class SliceRunner(ModelRunner):
    """The model runner of one rank; on rank 0 (`group` given) it also tells the workers what to run."""

    cuda_graphs_allowed = False  # (collectives are not captured)

    def __init__(self, model: LlamaDecoder, tp: TensorParallel, num_kv_blocks: int, config: EngineConfig,
                 device: torch.device, dtype: torch.dtype, logprob_fn: Any, capture_block_hidden: bool = False,
                 group: Any = None, key: int = 0) -> None:
        super().__init__(model, num_kv_blocks, config, device, dtype, logprob_fn, capture_block_hidden)
        self.tp, self.group, self.key = tp, group, key
        self.vocab = model.config.vocab_size
        self.vocab_start = model.vocab_range[0]

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden).float()  # [N, this rank's vocabulary rows]

    # ---- the step's collective parts (rank 0: broadcast, then the same as every rank) -------------------------
    def _run(self, op: str, wire: tuple, local: Any) -> Any:
        """Broadcast `op(*wire)` to the workers (rank 0), then compute this rank's part: local()."""
        if self.group is not None:
            self.group.call(self.key, op, *wire)
        try:
            return local()
        except BaseException as e:
            if self.group is not None:
                self.group.in_sync = False  # the workers may wait in a collective this rank left
                if isinstance(e, RanksFailed) and (note := failure_note()) is not None:
                    raise RanksFailed(note) from e  # a worker failed: its own error, not the transport's
            raise

    def _forward(self, batch: Any) -> torch.Tensor:
        inp = self._step_inputs(batch)
        return self._run("forward", (inp,), lambda: self.forward_inputs(inp))

    def _token_logprobs(self, hidden: torch.Tensor, rows: list[int], extra: list[torch.Tensor], targets: list[int],
                        k: int, ranks: bool, ref_hidden: None = None) -> TokenLogprobs:
        # (ref_hidden: always None, as a reference model is refused under tensor parallelism: engine/reference.py)
        return self._run("logprobs", (rows, [e.cpu() for e in extra], targets, k, ranks),
                         lambda: self.local_logprobs(hidden, rows, extra, targets, k, ranks))

    def _rows_logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return self._run("logits", (rows,), lambda: self.local_rows_logits(hidden, rows))

    # ---- what every rank computes ----------------------------------------------------------------------------
    def local_logprobs(self, hidden: torch.Tensor, rows: list[int], extra: list[torch.Tensor], targets: list[int],
                       k: int, ranks: bool) -> TokenLogprobs:
        """ModelRunner._token_logprobs over the vocabulary-parallel head (engine/parallel/logprobs.py)."""
        if extra:
            hidden = torch.cat([hidden, torch.stack(extra).to(device=hidden.device, dtype=hidden.dtype)])
        dev = hidden.device
        return parallel_token_logprobs(self.tp, self._local_logits, hidden[torch.tensor(rows, device=dev)],
                                       torch.tensor(targets, dtype=torch.int64, device=dev), k,
                                       self.logprobs_chunk_size, ranks, self.vocab_start, self.vocab)

    def local_rows_logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """fp32 logits [S, V] of hidden's rows `rows`, gathered from every rank's vocabulary rows."""
        picked = hidden[torch.tensor(rows, device=hidden.device)]
        return gathered_logits(self.tp, self._local_logits(picked), self.vocab)


class RankSlice:
    """One engine's slice on one rank: built by `load`, then `make_runner`; the rest are a step's parts."""

    def __init__(self, tp: TensorParallel, model: LlamaDecoder, ops: Ops, device: torch.device,
                 dtype: torch.dtype, config: EngineConfig | None = None) -> None:
        self.tp, self.model, self.ops, self.device, self.dtype = tp, model, ops, device, dtype
        self.config = config  # the engine's, which its runner reads
        self.runner: SliceRunner | None = None
        self.hidden: torch.Tensor | None = None  # the last forward's final hidden states [T, H]

    @classmethod
    def load(cls, tp: TensorParallel, args: LoadArgs) -> "RankSlice":
        """This rank's model slice, its weights read from args.weights (only its slices of a directory)."""
        cfg = args.config
        device = rank_device(args.device_type, tp.rank)
        ops = select_ops(cfg.attention_backend, device.type, cfg.batch_invariant)
        state = LazyCheckpoint(args.weights, args.dtype) if isinstance(args.weights, str) else args.weights
        model = build_decoder(args.hf_config, ops, args.max_positions, device, args.dtype, state, args.rope,
                              consume=False, tp=tp)
        return cls(tp, model, ops, device, args.dtype, cfg)

    def make_runner(self, num_kv_blocks: int, capture_block_hidden: bool = False, group: Any = None, key: int = 0
                    ) -> SliceRunner:
        """The rank's runner and KV cache (its KV heads) of `num_kv_blocks` blocks, with the engine's config;
        capture_block_hidden: rank 0's, for exact reuse's score store (the workers keep no results)."""
        if group is not None:
            group.call(key, "make_runner", num_kv_blocks, False)
        self.runner = SliceRunner(self.model, self.tp, num_kv_blocks, self.config, self.device, self.dtype,
                                  self.ops.token_logprobs, capture_block_hidden, group, key)
        return self.runner

    def pool_config(self) -> Any:
        """The model config the KV pool is sized with: on CUDA this rank's heads (each rank's pool lives on its own
        device); on the CPU the whole model's (the ranks' pools share the host's memory)."""
        if self.device.type != "cuda":
            return self.model.config
        attn = self.model.layers[0].self_attn
        cfg = copy.copy(self.model.config)
        cfg.num_key_value_heads, cfg.head_dim = attn.num_kv_heads, attn.head_dim
        return cfg

    def profile(self, step: dict[str, Any], group: Any = None, key: int = 0) -> int:
        """The largest step's peak memory on this rank (CUDA KV pool sizing); rank 0 gets the largest of all."""
        if group is not None:
            group.call(key, "profile", {k: v for k, v in step.items() if k != "device"})
        try:
            peak = profile_peak_memory(self.model, **{**step, "device": self.device})
            peaks = self.tp.gather(torch.tensor([peak], dtype=torch.int64, device=self.device))
        except BaseException:  # (e.g. out of memory) as SliceRunner._run: the workers may wait in the gather
            if group is not None:
                group.in_sync = False
            raise
        return int(max(int(p.item()) for p in peaks))

    # ---- a step's parts on a worker (serve, below, calls them by name) -------------------------
    def forward(self, inp: StepInputs) -> None:
        self.hidden = self.runner.forward_inputs(inp)

    def logprobs(self, rows: list[int], extra: list[torch.Tensor], targets: list[int], k: int, ranks: bool) -> None:
        self.runner.local_logprobs(self.hidden, rows, extra, targets, k, ranks)

    def logits(self, rows: list[int]) -> None:
        self.runner.local_rows_logits(self.hidden, rows)


@dataclass(frozen=True)
class ParallelContext:
    """Rank 0's view of one engine under tensor parallelism: its own slice, the group of ranks, and the key the
    workers file this engine's slices under."""

    rank_slice: RankSlice
    group: Any  # engine.parallel.ranks.RankGroup
    key: int

    def make_runner(self, num_kv_blocks: int, capture_block_hidden: bool = False) -> SliceRunner:
        """Rank 0's runner; the workers build theirs with the same pool size."""
        return self.rank_slice.make_runner(num_kv_blocks, capture_block_hidden, self.group, self.key)

    def profile(self, step: dict[str, Any]) -> int:
        """The largest step's peak memory over every rank (CUDA KV pool sizing)."""
        return self.rank_slice.profile(step, self.group, self.key)

    def drop(self) -> None:
        """The engine was not built (or is gone): the workers free its slices with the next call."""
        self.group.dropped.append(self.key)


def serve(tp: TensorParallel) -> None:
    """The worker loop: receive (engine key, operation, arguments) from rank 0 and run it on this rank's slice
    (`RankSlice`; rank 0 sends them through engine/parallel/ranks.RankGroup.call)."""
    import torch.distributed as dist

    slices: dict[int, RankSlice] = {}
    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0)
        key, op, args, drops = message[0]
        for d in drops:
            slices.pop(d, None)
        if op == "shutdown":
            return
        try:
            if op == "load":  # (built outside inference mode, as rank 0 builds its own)
                slices[key] = RankSlice.load(tp, *args)
            elif op == "make_runner":
                slices[key].make_runner(*args)
            else:
                with torch.inference_mode():  # as ModelRunner.execute on rank 0
                    getattr(slices[key], op)(*args)
        except BaseException as e:  # rank 0 may wait in this op's collective: tell it why this rank ends
            report_failure(tp.rank, e)
            raise


def load_args(hf_config: Any, state: Any, rope: Any, max_positions: int, config: EngineConfig,
              dtype: torch.dtype, device: torch.device) -> LoadArgs:
    """LoadArgs for `state`: a LazyCheckpoint travels as its directory (each rank opens it and reads its slices);
    a state dict travels whole to every rank (pickled: for tests and small models, native_engine_from_parts)."""
    weights = str(state.path) if isinstance(state, LazyCheckpoint) else dict(state)
    return LoadArgs(hf_config, weights, rope, max_positions, config, dtype, device.type)
