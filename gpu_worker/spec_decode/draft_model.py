"""Draft-model proposer: a smaller model with the target's vocabulary runs beside it in the worker and
proposes k tokens per sequence autoregressively after every step.

Its KV cache has one block per target block under the same ids, so the scheduler's block tables (and
its swapping and copy-on-write, which the runner applies to both caches) serve it unchanged. It only
ever computes verified tokens into the cache:

    after a step:  catch up  tokens [computed, end): a prefill chunk, or the accepted drafts and the new
                             sample (whose logits row gives draft 0)
                   draft     feed d0 .. d(k-2) one at a time at positions end .. end+k-2 (the scheduler
                             allocates k lookahead slots for them) -> d1 .. d(k-1)

The drafts it fed stay in its cache; when the next step accepts some of them, the catch-up skips them.
A greedy request drafts the draft's argmax (deterministic, verified by matching); a sampled one draws from
the draft's distribution under the request's own parameters, kept for the rejection test. A seeded draft
draws with the noise the target would use at that output index (the verifier's draws are a stream apart),
so a model drafting for itself reproduces the target's seeded samples.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from common.config import EngineConfig
from common.model_source import ModelSource
from common.speculative import SpeculativeConfig
from gpu_worker.attention import allocate_kv_cache, get_backend, kv_block_bytes, resolve_kv_cache_dtype
from gpu_worker.cpu_precision import int16_activations
from gpu_worker.sampler import build_sampling_batch, draw
from gpu_worker.spec_decode.proposer import CachePair, Drafts, Proposer
from gpu_worker.spec_decode.rejection import accepted_drafts
from gpu_worker.step_inputs import SequenceState, build_step_inputs, decode_inputs, row_state
from gpu_worker.weight_loader import load_model


@dataclass
class _DraftState:
    computed: int                                   # leading tokens whose KV is in the draft cache
    fed: list[int] = field(default_factory=list)    # drafts fed at positions computed.. (valid while they match)


class DraftModelProposer(Proposer):
    def __init__(self, spec: SpeculativeConfig, engine: EngineConfig, target_vocab: int, device: torch.device,
                 dtype: torch.dtype, max_model_len: int, block_size: int, eos_ids: set[int]):
        self.num_speculative_tokens = spec.num_speculative_tokens
        source = ModelSource.resolve(spec.model)
        self.model_config = source.model_config()
        spec.check_vocab(target_vocab, self.model_config.vocab_size)
        # int16 activations as the target's (a model drafting for itself then drafts its own tokens)
        self.model = load_model(source, self.model_config, dtype, device, max_model_len, engine.quantization,
                                engine.load_format, int16_activations=int16_activations(engine.dtype, device))
        self.backend = get_backend(engine.attention_backend, device)
        self.device, self.kv_dtype = device, resolve_kv_cache_dtype(engine.kv_cache_dtype, dtype)
        self.max_model_len, self.block_size = max_model_len, block_size
        self.eos_ids = eos_ids                     # the runner's set: it gains the tokenizer's at start-up
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.host_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._last_hidden: dict[str, torch.Tensor] = {}   # seq_id -> hidden row predicting draft 0

    # ---- cache ---------------------------------------------------------------------------------
    def block_bytes(self, block_size: int) -> int:
        return kv_block_bytes(self.model_config, block_size, self.kv_dtype)

    def init_cache(self, num_blocks: int, num_host_blocks: int) -> None:
        self.kv_caches, self.host_caches = allocate_kv_cache(self.model_config, num_blocks, num_host_blocks,
                                                             self.block_size, self.kv_dtype, self.device)

    def caches(self) -> list[CachePair]:
        return [(self.kv_caches, self.host_caches)]

    # ---- every step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def observe(self, seqs: list[SequenceState], ends: list[int]) -> None:
        """Compute the draft's KV for the step's verified tokens, keeping the last hidden row of every
        sequence that sampled (it predicts draft 0)."""
        self._last_hidden.clear()
        views, scheduled = {}, []
        for st, end in zip(seqs, ends):
            ds = st.proposer_state
            if ds is None:     # new to the worker (or rebuilt after a preemption): its cache holds what the target's does
                ds = st.proposer_state = _DraftState(st.num_computed_tokens)
            ds.computed += accepted_drafts(ds.fed, st.token_ids[ds.computed:end])
            ds.fed = []
            if end > ds.computed:
                views[st.seq_id] = replace(st, num_computed_tokens=ds.computed, spec_token_ids=[])
                scheduled.append((st.seq_id, end - ds.computed))
                ds.computed = end
        if not scheduled:
            return
        inputs = build_step_inputs(views, scheduled, self.block_size, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, self.backend.prepare(inputs.attn),
                            self.backend, inputs.seq_ends)
        last = hidden[inputs.logits_indices]
        for i, seq_id in enumerate(inputs.sample_seq_ids):
            self._last_hidden[seq_id] = last[i]

    @torch.inference_mode()
    def propose(self, seqs: list[SequenceState]) -> list[Drafts]:
        """k autoregressive draft steps over the sequences observe() saw sample (others get no drafts)."""
        live = [i for i, st in enumerate(seqs) if st.seq_id in self._last_hidden and self._room(st) > 0]
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        if not live:
            return [Drafts([]) for _ in seqs]
        hidden = torch.stack([self._last_hidden[seqs[i].seq_id] for i in live])
        for j in range(self.num_speculative_tokens):
            tokens = self._draw(hidden, [seqs[i] for i in live], [drafts[i] for i in live], [probs[i] for i in live])
            for i, t in zip(live, tokens):
                drafts[i].append(t)
            live = [i for i in live if len(drafts[i]) < self._room(seqs[i])]
            if not live or j == self.num_speculative_tokens - 1:
                break
            hidden = self._feed([seqs[i] for i in live], [drafts[i] for i in live])
        return [Drafts(d, torch.stack(p) if p else None) for d, p in zip(drafts, probs)]

    def _room(self, st: SequenceState) -> int:
        """Drafts that fit: draft j+1 needs draft j's KV at position len + j, in an allocated slot."""
        cap = min(len(st.block_ids) * self.block_size, self.max_model_len)
        return min(self.num_speculative_tokens, cap - len(st.token_ids) + 1)

    def _draw(self, hidden: torch.Tensor, seqs: list[SequenceState], drafts: list[list[int]],
              probs: list[list[torch.Tensor]]) -> list[int]:
        """One draft token per sequence under its own sampling parameters; sampled rows keep q."""
        logits = self.model.compute_logits(hidden).float()
        rows = [row_state(st, d) for st, d in zip(seqs, drafts)]
        s = draw(logits, build_sampling_batch(rows, logits.shape[-1], self.eos_ids, self.device))
        for st, p, row_probs in zip(seqs, probs, s.probs if s.probs is not None else [None] * len(seqs)):
            if not st.params.greedy:
                p.append(row_probs)
        return s.ids.tolist()

    def _feed(self, seqs: list[SequenceState], drafts: list[list[int]]) -> torch.Tensor:
        """Run each sequence's newest draft at its position; returns the hidden rows predicting the next."""
        positions = [len(st.token_ids) + len(d) - 1 for st, d in zip(seqs, drafts)]
        ids, pos, meta = decode_inputs([st.block_ids for st in seqs], positions, [d[-1] for d in drafts],
                                       self.block_size, self.device)
        for st, d in zip(seqs, drafts):
            st.proposer_state.fed = list(d)
        return self.model(ids, pos, self.kv_caches, self.backend.prepare(meta), self.backend)
