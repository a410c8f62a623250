"""GPTModel whose last stage scores only selected positions (the selective LM head).

A subclass, not a patch: ``forward`` accepts a :class:`TokenSelection`; on the last pipeline
stage ``_postprocess`` gathers sequence-parallel hidden states, indexes the selected positions and
returns their label log-probs through the fused vocab-parallel op. No full-vocabulary logits are
formed. Without a selection the model behaves exactly like Megatron's ``GPTModel``.

``forward(..., segments=layout)`` runs a :class:`~megatron_prune.model.segments.SegmentLayout`
(shared prompts, packed sequences): every layer's attention follows the layout and the rotary
embedding is taken per token from ``position_ids`` instead of from the row index (Megatron-Core's
RoPE reads the row index and ignores ``position_ids``; a token placed after another segment, such
as a rejected response after the chosen one, must rotate as if it followed its prefix). Where the
layer spec's core attention is our :class:`~megatron_prune.model.segment_attention.SegmentAttention`
the layout reaches it as a segment table and only the pairs it allows are computed; otherwise the
layout's dense mask is used.

``forward(..., padding_mask=mask)`` (``[b, s]`` bool, True at padding) keeps padding out of a
mixture-of-experts model's router losses; it changes nothing else (routing is drop-less, so pad
tokens still run through the experts and their outputs are never scored).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass

import torch

from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from megatron_prune.model.lora import adapter_dropout_pass
from megatron_prune.model.segments import SegmentLayout
from megatron_prune.ops import vocab_parallel_logprobs

DEFAULT_CHUNK_SIZE = 4096


@functools.lru_cache(maxsize=None)
def _takes_padding_mask(forward) -> bool:
    """Whether ``forward`` (``GPTModel.forward`` as it is now) takes the router's padding mask: a
    stack that replaced it after import (an accelerator adaptor, an older core) gets none rather
    than an unexpected keyword. Keyed on the function, so a later replacement is seen."""
    return "padding_mask" in inspect.signature(forward).parameters


def _to(value, device: torch.device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


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

    def to(self, device: torch.device) -> "TokenSelection":
        """This selection with every tensor on ``device``."""
        return dataclasses.replace(self, **{f.name: _to(getattr(self, f.name), device) for f in dataclasses.fields(self)})


class SelectiveGPTModel(GPTModel):
    """Megatron ``GPTModel`` plus a selective, vocab-parallel log-prob head."""

    def __init__(self, *args, true_vocab_size: int, logprob_chunk_size: int = DEFAULT_CHUNK_SIZE, **kwargs):
        super().__init__(*args, **kwargs)
        self.true_vocab_size = true_vocab_size
        self.logprob_chunk_size = logprob_chunk_size
        self._selection: TokenSelection | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *args,
        token_selection: TokenSelection | None = None,
        segments: SegmentLayout | None = None,
        padding_mask: torch.Tensor | None = None,
        **kwargs,
    ):
        # Batches are built on the CPU; they reach the accelerator here, in the one place every
        # forward step, loss and rollout goes through.
        device = self._device()
        input_ids, position_ids, attention_mask = (_to(t, device) for t in (input_ids, position_ids, attention_mask))
        if token_selection is not None:
            token_selection = token_selection.to(device)
        if "labels" in kwargs:
            kwargs["labels"] = _to(kwargs["labels"], device)
        if segments is not None:
            attention_mask = self._segment_attention_input(segments, position_ids, attention_mask)
        padding_mask = self._router_padding_mask(padding_mask, device)
        if padding_mask is not None:
            kwargs["padding_mask"] = padding_mask
        self._selection = token_selection
        self._segment_positions = position_ids if segments is not None else None
        try:
            with adapter_dropout_pass():
                return super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)
        finally:
            self._selection = None
            self._segment_positions = None

    def _router_padding_mask(self, mask: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
        """``mask`` as Megatron's MoE routers take it on this stage, or None where it changes nothing:
        a dense model, no padding, or nothing but padding (a placeholder microbatch, whose router
        losses are scaled to 0; a mean over no tokens would be NaN)."""
        if mask is None or not self.config.num_moe_experts or not bool(mask.any()) or bool(mask.all()):
            return None
        if not _takes_padding_mask(GPTModel.forward):
            return None
        mask = mask.to(device=device, dtype=torch.bool)
        if not self.pre_process and self.config.sequence_parallel:
            # Megatron scatters the mask along the sequence on the first stage only; a later stage
            # takes this tensor-parallel rank's shard itself, as the scatter would have.
            from megatron.core import parallel_state

            tp = parallel_state.get_tensor_model_parallel_world_size()
            shard = mask.shape[1] // tp
            rank = parallel_state.get_tensor_model_parallel_rank()
            mask = mask[:, rank * shard : (rank + 1) * shard].contiguous()
        return mask

    def _device(self) -> torch.device:
        param = next(self.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    def _segment_attention_input(
        self, segments: SegmentLayout, position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """What is handed to the decoder as ``attention_mask`` for ``segments``."""
        if attention_mask is not None:
            raise ValueError("pass either an attention_mask or segments, not both")
        if position_ids is None or position_ids.dim() != 2:
            raise ValueError("segments need per-token position_ids of shape [b, s]")
        from megatron_prune.model.segment_attention import prefix_kv_length

        stored = prefix_kv_length()  # inside attend_to_prefix_kv: the layout also covers the stored rows
        if tuple(position_ids.shape) != (segments.batch_size, segments.seq_length - stored):
            raise ValueError(
                f"segments describe {segments.batch_size} rows of {segments.seq_length} tokens "
                f"({stored} of them stored prefix keys and values) but position_ids are {list(position_ids.shape)}"
            )
        if self.position_embedding_type != "rope":
            raise ValueError(f"segments need rotary position embeddings, not {self.position_embedding_type!r}")
        if self.config.context_parallel_size > 1:
            raise ValueError("segments do not support context parallelism")
        if self._segment_attention_in_spec():
            return segments.to_table()
        if stored:
            raise ValueError("attending to stored prefix keys and values needs segment attention in every layer")
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        others = {type(core).__name__ for core in self._core_attentions() if not isinstance(core, DotProductAttention)}
        if others:
            # Transformer Engine's core attention under a causal mask type ignores a dense mask.
            raise ValueError(f"segments need segment attention or Megatron's DotProductAttention; this model's "
                             f"layers use {', '.join(sorted(others))}")
        return segments.dense_mask().to(position_ids.device)

    def _core_attentions(self) -> list:
        return [getattr(layer.self_attention, "core_attention", None) for layer in getattr(self.decoder, "layers", [])]

    def _segment_attention_in_spec(self) -> bool:
        from megatron_prune.model.segment_attention import SegmentAttentionMixin

        cores = self._core_attentions()
        return len(cores) > 0 and all(isinstance(core, SegmentAttentionMixin) for core in cores)

    def _preprocess(self, input_ids, position_ids, *args, **kwargs):
        out = super()._preprocess(input_ids, position_ids, *args, **kwargs)
        positions = getattr(self, "_segment_positions", None)
        if positions is None or out[1] is None:
            return out
        return (out[0], self._per_token_rotary(positions), *out[2:])

    def _per_token_rotary(self, position_ids: torch.Tensor) -> torch.Tensor:
        """``[s, b, 1, d]`` rotary angles of each token's own position (Megatron's ``get_emb`` per token)."""
        rope = self.rotary_pos_emb
        positions = position_ids.transpose(0, 1).to(device=rope.inv_freq.device, dtype=rope.inv_freq.dtype)
        if rope.seq_len_interpolation_factor is not None:
            positions = positions * (1 / rope.seq_len_interpolation_factor)
        freqs = positions[..., None] * rope.inv_freq  # [s, b, d/2]
        if rope.rotary_interleaved:
            emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, :, None, :]

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
        if selection.temperature is not None:
            logits = logits.float() / self._position_temperature(selection, logits.shape[:2])
        v_local = logits.shape[-1]
        start = self.pg_collection.tp.rank() * v_local
        if start + v_local > self.true_vocab_size:
            # Padded vocabulary rows are not tokens: keep them out of the normalisation.
            ids = torch.arange(start, start + v_local, device=logits.device)
            logits = logits.masked_fill(ids >= self.true_vocab_size, torch.finfo(logits.dtype).min)
        labels = selection.all_labels.transpose(0, 1).contiguous()  # [s, b]
        logprobs = -vocab_parallel_cross_entropy(logits.float(), labels)  # [s, b]
        return logprobs.reshape(-1).index_select(0, selection.index)

    @staticmethod
    def _position_temperature(selection: TokenSelection, shape: torch.Size) -> torch.Tensor:
        """``[s, b, 1]`` fp32 temperature of every position for the baseline head: the selection's
        (scalar, or per selected row at its position), 1 where nothing is scored."""
        t = selection.temperature
        t = torch.as_tensor(t, dtype=torch.float32, device=selection.index.device).detach()
        if not bool((t > 0).all()):
            raise ValueError("temperature must be positive (and not NaN) for every row")
        if t.numel() == 1:
            return t.reshape(1, 1, 1)
        if t.shape != selection.index.shape:
            raise ValueError(f"temperature must be a scalar or a [n] = [{selection.index.numel()}] tensor; "
                             f"got {tuple(t.shape)}")
        per_position = torch.ones(shape.numel(), dtype=torch.float32, device=t.device)
        per_position[selection.index] = t
        return per_position.reshape(*shape, 1)
