"""GPTModel whose last stage scores only selected positions (the selective LM head).

A subclass, not a patch: ``forward`` accepts a :class:`TokenSelection`; on the last pipeline
stage ``_postprocess`` gathers sequence-parallel hidden states, indexes the selected positions and
returns their label log-probs through the fused vocab-parallel op. No full-vocabulary logits are
formed. Without a selection the model behaves exactly like Megatron's ``GPTModel``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from megatron_prune.ops import vocab_parallel_logprobs

DEFAULT_CHUNK_SIZE = 4096


@dataclass
class TokenSelection:
    """Positions to score, as flat indices into the ``[s, b]`` activation layout."""

    index: torch.Tensor
    """[n] int64: ``position * micro_batch_size + row`` for each scored token."""
    labels: torch.Tensor
    """[n] int64: the token id whose log-prob is wanted at each selected position."""
    seq_ids: torch.Tensor
    """[n] int64: which sequence (sample/branch) each selected token belongs to."""
    temperature: float | torch.Tensor | None = None
    """Sampling temperature (scalar or [n]) dividing the logits, so training log-probs match the
    rollout's sampling distribution (GRPO)."""
    all_labels: torch.Tensor | None = None
    """[b, s] next-token labels. When set, the head runs the unpruned baseline path instead:
    full-vocabulary logits at every position and Megatron's vocab-parallel cross entropy, then
    the selected positions are picked out (for Full / Full-concat comparisons)."""

    def __post_init__(self) -> None:
        assert self.index.shape == self.labels.shape == self.seq_ids.shape, "selection fields must align"


class SelectiveGPTModel(GPTModel):
    """Megatron ``GPTModel`` plus a selective, vocab-parallel log-prob head."""

    def __init__(self, *args, true_vocab_size: int, logprob_chunk_size: int = DEFAULT_CHUNK_SIZE, **kwargs):
        super().__init__(*args, **kwargs)
        self.true_vocab_size = true_vocab_size
        self.logprob_chunk_size = logprob_chunk_size
        self._selection: TokenSelection | None = None

    def forward(self, *args, token_selection: TokenSelection | None = None, **kwargs):
        self._selection = token_selection
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._selection = None

    def _postprocess(self, hidden_states, *args, **kwargs):
        selection = self._selection
        if selection is None or not self.post_process:
            return super()._postprocess(hidden_states, *args, **kwargs)
        if selection.all_labels is not None:
            return self._full_logits_logprobs(hidden_states, selection)
        if self.config.sequence_parallel:
            # The op returns the complete (TP-summed) gradient, so the gather's backward only splits.
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=self.pg_collection.tp
            )
        s, b, h = hidden_states.shape
        selected = hidden_states.reshape(s * b, h).index_select(0, selection.index)
        weight = (
            self.shared_embedding_or_output_weight()
            if self.share_embeddings_and_output_weights
            else self.output_layer.weight
        )
        return vocab_parallel_logprobs(
            selected,
            weight,
            selection.labels,
            chunk_size=self.logprob_chunk_size,
            tp_group=self.pg_collection.tp,
            vocab_size=self.true_vocab_size,
            temperature=selection.temperature,
        )

    def _full_logits_logprobs(self, hidden_states: torch.Tensor, selection: TokenSelection) -> torch.Tensor:
        """Baseline head: logits for every position, vocab-parallel CE, then the selected rows."""
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(hidden_states, weight=weight)  # [s, b, V/tp]
        v_local = logits.shape[-1]
        start = self.pg_collection.tp.rank() * v_local
        if start + v_local > self.true_vocab_size:
            # Padded vocabulary rows are not tokens: keep them out of the normalisation.
            ids = torch.arange(start, start + v_local, device=logits.device)
            logits = logits.masked_fill(ids >= self.true_vocab_size, torch.finfo(logits.dtype).min)
        labels = selection.all_labels.transpose(0, 1).contiguous()  # [s, b]
        logprobs = -vocab_parallel_cross_entropy(logits.float(), labels)  # [s, b]
        return logprobs.reshape(-1).index_select(0, selection.index)
