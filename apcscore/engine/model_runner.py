"""Model runner: turns a scheduled batch into flat tensors, runs the model, scores and samples.

Logits are computed only for the rows that need them: every scored prompt position (prompt logprobs)
and the last position of each sequence that samples its next token. With exact reuse's score store, a sequence
that read stored results also scores its boundary row from the stored hidden state (`Sequence.boundary_hidden`),
and the final hidden state of each block's last position is captured for the store (`Sequence.block_hidden`).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import numpy as np
import torch

from apcscore.attention.decode_groups import DecodeGroups, group_shape, step_decode_groups
from apcscore.attention.metadata import AttentionMetadata, set_attention_metadata
from apcscore.config import EngineConfig
from apcscore.engine.host_memory import keep_freed_memory
from apcscore.engine.kv_cache import allocate_kv_cache
from apcscore.engine.logprobs import LogprobFn, chunked_token_logprobs, to_token_logprobs
from apcscore.engine.paired_rows import PairedRows
from apcscore.engine.sampler import sample_rows, sampling_seed
from apcscore.engine.step import ScheduledBatch, Sequence, StepInputs, TokenLogprobs
from apcscore.engine.score_store import publishes
from apcscore.engine.step_inputs import build_step_inputs
from apcscore.kernels.buffers import reused_buffer
from apcscore.kernels.logprobs_torch import token_logprobs_torch
from apcscore.kernels.matmul_torch import padded_rows
from apcscore.models.llama import LlamaDecoder

_ALIGN = 64  # bytes: every staged array starts 64-byte aligned, as a fresh allocation would (Triton specialises on it)


class ModelRunner:
    cuda_graphs_allowed = True  # (not for the tensor-parallel SliceRunner: collectives are not captured)

    def __init__(self, model: LlamaDecoder, num_kv_blocks: int, config: EngineConfig, device: torch.device,
                 dtype: torch.dtype, logprob_fn: LogprobFn = token_logprobs_torch,
                 capture_block_hidden: bool = False) -> None:
        """Reads config's block_size, logprobs_chunk_size, seed (of a sampled request without its own), and
        use_cuda_graphs and max_num_seqs (the decode batch sizes captured, engine/cuda_graphs.py)."""
        self.model = model
        self.config = config
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.logprobs_chunk_size = config.logprobs_chunk_size
        self.logprob_fn = logprob_fn
        self.capture_block_hidden = capture_block_hidden  # exact reuse: feed the score store
        self.reference: ModelRunner | None = None  # the reference model's runner, same pool size (engine/reference.py)
        self.rope_offset = model.long_rope_after or 0  # long-rope sequences' table rows (step_inputs)
        # big logprob temporaries are reused on the CPU (the torch fn); CUDA's caching allocator reuses them anyway
        self.reuses_buffers = device.type == "cpu" and logprob_fn is token_logprobs_torch
        if device.type == "cpu":
            keep_freed_memory()  # activations reuse freed heap memory, no page faults per step
        allocate_kv_cache(model, num_kv_blocks, self.block_size, dtype, device)
        # to_device on CUDA: two pinned uint8 buffers used in turn, each with the event of its last copy
        self._pinned: list[torch.Tensor] = []
        self._copied: list[torch.cuda.Event | None] = []
        self._turn = 0
        # Triton backend: decode sequences sharing prefix blocks run as groups (attention/decode_groups.py);
        # None (the torch backend, or turned off): every step's metadata is built exactly as without groups
        self.decode_group_shape = group_shape(model.layers[0].self_attn)
        self.cuda_graphs = None  # decode-only batches replay CUDA graphs (apcscore.engine.cuda_graphs), captured now
        if device.type == "cuda" and config.use_cuda_graphs and self.cuda_graphs_allowed:
            from apcscore.engine.cuda_graphs import DecodeGraphRunner

            self.cuda_graphs = DecodeGraphRunner.for_model(model, config, device, self.to_device)

    # ---- batch preparation ---------------------------------------------------------------------
    def _step_inputs(self, batch: ScheduledBatch) -> StepInputs:
        # CPU: every GEMM of the step then runs on a multiple of 16 rows, the batch-invariant shape
        # (apcscore.kernels.matmul_torch), with no per-layer padding copy
        num_rows = padded_rows(sum(n for _, n in batch)) if self.device.type == "cpu" else None
        return build_step_inputs(batch, self.block_size, num_rows, self.rope_offset)

    def _stage(self, inp: StepInputs) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """A step's host inputs on the device: input_ids [T], positions [T], the attention metadata."""
        shape = self.decode_group_shape
        groups = None if shape is None else step_decode_groups(inp.cu_seqlens_q, inp.seq_lens, inp.block_tables,
                                                                self.block_size, shape)
        staged = self.to_device(inp.input_ids, inp.positions, inp.slot_mapping, inp.cu_seqlens_q,
                                inp.seq_lens, inp.block_tables, *(groups or ()))
        input_ids, positions, slots, cu, seq_lens, tables = staged[:6]
        meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, cu_seqlens_q=cu, seq_lens=seq_lens,
                                 cu_seqlens_q_list=inp.cu_seqlens_q.tolist(), seq_lens_list=inp.seq_lens.tolist(),
                                 block_size=self.block_size)
        if groups:
            meta.decode_groups = DecodeGroups(staged[6], staged[7], *shape)
        return input_ids, positions, meta

    def to_device(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """Host arrays as tensors on the device, in order: zero-copy on the CPU; on CUDA one non-blocking copy out
        of a persistent pinned buffer (two used in turn, each refilled only once its previous copy has finished), so
        staging a step neither allocates pinned memory nor waits for the GPU. The tensors are fresh (stream-ordered
        caching allocations): they stay valid while the caller holds them, whatever later steps stage."""
        if self.device.type != "cuda":
            return [torch.from_numpy(np.ascontiguousarray(a)).to(self.device) for a in arrays]
        offsets, end = [], 0
        for a in arrays:
            offsets.append(end)
            end += -(-a.nbytes // _ALIGN) * _ALIGN
        i = self._pinned_slot(end)
        host = self._pinned[i]
        for a, off in zip(arrays, offsets):
            host[off:off + a.nbytes].numpy().view(a.dtype).reshape(a.shape)[...] = a
        dev = host[:end].to(self.device, non_blocking=True)  # the one copy of the step
        event = self._copied[i] = self._copied[i] or torch.cuda.Event()
        event.record()
        dtypes = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}
        return [dev[off:off + a.nbytes].view(dtypes[a.dtype]).view(a.shape) for a, off in zip(arrays, offsets)]

    def _pinned_slot(self, nbytes: int) -> int:
        """A pinned buffer of at least nbytes whose last copy has finished (both buffers grow together)."""
        if not self._pinned or self._pinned[0].numel() < nbytes:
            for event in self._copied:
                if event is not None:
                    event.synchronize()  # growing (rare): the old buffers may still be read
            size = max(nbytes, 2 * self._pinned[0].numel() if self._pinned else 1 << 16)
            self._pinned = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            self._copied = [None, None]
        i, self._turn = self._turn, 1 - self._turn
        event = self._copied[i]
        if event is not None and not event.query():  # normally long done: the step between read its results
            event.synchronize()
        return i

    # ---- the step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[tuple[Sequence, int, TokenLogprobs | None]]:
        """Run one step. What it scored goes onto its sequences (`prompt_logprob_parts`, `alternative_logprobs`,
        and for the score store `block_hidden`); returns each sampling sequence's token and its logprobs."""
        hidden = self.cuda_graphs.forward(batch) if self.cuda_graphs is not None else None  # [n, H] or None
        if hidden is None:
            hidden = self._forward(batch)  # [T, H]
        if self.capture_block_hidden:
            for seq, block_hidden in self._block_hidden(batch, hidden):
                seq.block_hidden = block_hidden
        ref_hidden = self.reference._forward(batch) if self.reference is not None else None  # [T, H]; fills its KV
        prompt_lps, alternatives = self._score_prompts(batch, hidden, ref_hidden)
        for seq, lps in prompt_lps:
            seq.prompt_logprob_parts.append(lps)
        for seq, lps in alternatives:
            seq.alternative_logprobs = lps
        return self._sample(batch, hidden)

    def _forward(self, batch: ScheduledBatch) -> torch.Tensor:
        """The step's final hidden states [T, H] (eager); engine/parallel/runner.py broadcasts the inputs first."""
        return self.forward_inputs(self._step_inputs(batch))

    def forward_inputs(self, inp: StepInputs) -> torch.Tensor:
        """The model over one step's host inputs: final hidden states [T, H]."""
        input_ids, positions, meta = self._stage(inp)
        with set_attention_metadata(meta):
            return self.model(input_ids, positions)

    def _block_hidden(self, batch: ScheduledBatch,
                      hidden: torch.Tensor) -> list[tuple[Sequence, dict[int, torch.Tensor]]]:
        """The final hidden states of the block-ending positions this step computed, for blocks whose score-store
        entry the sequence writes (score_store.publishes), copied to host memory in one transfer."""
        bs = self.block_size
        picks: list[tuple[Sequence, int, int]] = []  # seq, block index, row in hidden
        offset = 0
        for seq, n in batch:
            start = seq.num_computed_tokens
            for j in range(start // bs, (start + n) // bs):  # blocks whose last position is in [start, start + n)
                if seq.scores_prompt and publishes(seq.request, j, bs, seq.prompt_len):
                    picks.append((seq, j, offset + (j + 1) * bs - 1 - start))
            offset += n
        if not picks:
            return []
        rows = hidden[torch.tensor([r for *_, r in picks], device=hidden.device)].cpu()  # [P, H]
        out: dict[int, tuple[Sequence, dict[int, torch.Tensor]]] = {}
        for i, (seq, j, _) in enumerate(picks):
            out.setdefault(id(seq), (seq, {}))[1][j] = rows[i].clone()
        return list(out.values())

    def _logits(self, hidden: torch.Tensor, buffer: str | None = None) -> torch.Tensor:
        """[N, H] -> fp32 logits [N, V], batch-invariant (see LlamaDecoder.compute_logits); in this thread's reused
        buffer for the use `buffer` (kernels/buffers.py) if given and this runner reuses buffers."""
        out = None
        if buffer is not None and self.reuses_buffers:
            vocab = self.model.lm_head_weight.shape[0]
            out = reused_buffer(buffer, (padded_rows(hidden.shape[0]), vocab), torch.float32)
        return self.model.compute_logits(hidden, out)

    def _score_prompts(self, batch: ScheduledBatch, hidden: torch.Tensor, ref_hidden: torch.Tensor | None = None
                       ) -> tuple[list[tuple[Sequence, TokenLogprobs]], list[tuple[Sequence, TokenLogprobs]]]:
        """Row q of a sequence predicts its token q + 1: score the prompt tokens this chunk can see, and a
        sequence's last-token alternatives once its last prompt token is scored: more rows of the same hidden
        state with other targets (the LM head and the logprob function are row-wise: bitwise the same values
        as separate requests)."""
        rows: list[int] = []
        targets: list[int] = []
        spans: list[tuple[Sequence, int, int, int]] = []  # seq, first row in `rows`, count, first target pos
        alt_spans: list[tuple[Sequence, int, int]] = []  # seq, first row in `rows`, count
        extra: list[torch.Tensor] = []  # stored boundary hidden states, rows hidden.shape[0] + i of the source
        offset = 0
        for seq, n in batch:
            req = seq.request
            start = seq.num_computed_tokens
            if seq.scores_prompt:
                boundary = seq.boundary_hidden is not None  # row start - 1, from the score store
                q0 = start - 1 if boundary else max(start, req.score_from - 1)
                q1 = min(start + n, seq.prompt_len - 1)
                if q1 > q0:
                    spans.append((seq, len(rows), q1 - q0, q0 + 1))
                    if boundary:
                        rows.append(hidden.shape[0] + len(extra))
                        extra.append(seq.boundary_hidden)
                    rows += range(offset + max(q0, start) - start, offset + q1 - start)
                    targets += seq.token_ids[q0 + 1:q1 + 1]
                    alts = req.last_token_alternatives
                    if alts and q1 == seq.prompt_len - 1:  # rows[-1] is row prompt_len - 2: the last token's
                        alt_spans.append((seq, len(rows), len(alts)))
                        rows += [rows[-1]] * len(alts)
                        targets += alts
            offset += n
        if not rows:
            return [], []
        k = max(seq.request.prompt_logprobs for seq, *_ in spans)
        lps = self._token_logprobs(hidden, rows, extra, targets, k,
                                   any(seq.request.prompt_logprob_ranks for seq, *_ in spans), ref_hidden)
        out = [(seq, replace(lps.rows(first, first + count, seq.request.prompt_logprobs),
                             positions=np.arange(pos0, pos0 + count, dtype=np.int64)))
               for seq, first, count, pos0 in spans]
        alternatives = [(seq, lps.rows(first, first + count, seq.request.prompt_logprobs))
                        for seq, first, count in alt_spans]
        return out, alternatives

    def _token_logprobs(self, hidden: torch.Tensor, rows: list[int], extra: list[torch.Tensor], targets: list[int],
                        k: int, ranks: bool, ref_hidden: torch.Tensor | None = None) -> TokenLogprobs:
        """Score targets[i] from row rows[i] of hidden [T, H] followed by the `extra` rows (stored boundary
        hidden states [H] each): logprob, rank (if ranks) and top-k, in logprobs_chunk_size row chunks; with the
        reference's hidden states [T, H] (no extra rows: no exact reuse), its divergence at each row too."""
        if extra:
            hidden = torch.cat([hidden, torch.stack(extra).to(device=hidden.device, dtype=hidden.dtype)])
        dev = hidden.device
        index = torch.tensor(rows, device=dev)
        # the model's and the reference's logits chunks are alive together: two buffers
        paired = None if ref_hidden is None or self.reference is None else \
            PairedRows(partial(self.reference._logits, buffer="reference logits"), ref_hidden[index])
        fn = partial(self.logprob_fn, reuse_buffers=True) if self.reuses_buffers else self.logprob_fn
        lps = chunked_token_logprobs(partial(self._logits, buffer="logits"), hidden[index],
                                     torch.tensor(targets, dtype=torch.int64, device=dev), k, self.logprobs_chunk_size,
                                     fn, ranks=ranks, beside=paired)
        if paired is not None:
            lps.divergence = paired.result()
        return lps

    def _rows_logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """fp32 logits [S, V] of rows `rows` (ascending) of hidden [T, H]."""
        contiguous = rows[-1] - rows[0] == len(rows) - 1  # decode batches: a slice, no host-to-device copy (sync)
        picked = hidden[rows[0]:rows[-1] + 1] if contiguous else hidden[torch.tensor(rows, device=hidden.device)]
        return self._logits(picked).float()

    def _sample(self, batch: ScheduledBatch, hidden: torch.Tensor) -> list[tuple[Sequence, int, TokenLogprobs | None]]:
        rows: list[int] = []
        seqs: list[Sequence] = []
        offset = 0
        for seq, n in batch:
            offset += n
            if seq.num_computed_tokens + n == seq.num_tokens and seq.request.max_tokens > len(seq.output_token_ids):
                rows.append(offset - 1)
                seqs.append(seq)
        if not rows:
            return []
        logits = self._rows_logits(hidden, rows)  # [S, V]
        params = [seq.request.sampling for seq in seqs]
        for seq, p in zip(seqs, params):
            if p.temperature > 0 and seq.generator is None:
                seed = sampling_seed(p, self.config.seed, seq.arrival)
                seq.generator = torch.Generator(device=hidden.device).manual_seed(seed)
        sampled = sample_rows(logits, params, [seq.generator for seq in seqs])  # [S] on the device
        want = [p.logprobs for p in params]
        lps = None
        if any(w is not None for w in want):
            lps = to_token_logprobs(sampled, *self.logprob_fn(logits, sampled, max(w or 0 for w in want)))
        tokens = sampled.tolist()  # the step's one read of the sampled tokens
        return [(seq, tok, None if want[i] is None else lps.rows(i, i + 1, want[i]))
                for i, (seq, tok) in enumerate(zip(seqs, tokens))]
