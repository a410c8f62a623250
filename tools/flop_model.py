"""FLOP and activation-memory model of one DPO step, for holding measured speedups against their limit.

A step is a list of :class:`Pass` es (reference forward, pruned-branch forward, training
forward-backward), each a list of :class:`Microbatch` es whose rows hold one or more sequences.
Costs, in matmul FLOPs (2 per multiply-add):

- forward  = body (q/k/v/o projections, SwiGLU MLP: ``2 * params`` per token, plus the attention
  core ``QK^T`` and ``AV``: ``4 * heads * head_dim`` per attended (query, key) pair, causal) +
  head (``2 * hidden * vocab`` per row the LM head projects);
- a mixture-of-experts layer counts its *active* parameters per token: the router
  (``hidden x num_experts``) plus the SwiGLU MLPs of the ``top_k`` experts the token is routed to
  (width ``expert_ffn``), not all ``num_experts``; the model's dense layers keep the dense MLP
  (drop-less routing: every token reaches its top-k experts);
- a training pass costs forward + backward = 3 x forward; full recompute adds one more body
  forward; the reference and a pruned branch are forward only.

Under LoRA (``lora_rank > 0``) base weights are frozen: a training pass is the forward, the
activation gradients (``dX``: the body's weight matmuls once more; the attention core, which has no
weights, twice as before; the head once) and the adapter terms (``2 r (in + out)`` per token and
adapted linear forward, three times that in training: forward, ``dX`` and the adapter weights'
gradients); there are no base-weight gradients (one forward less of the weight matmuls). The
reference is the policy with adapters off (:class:`Pass` ``adapters=False``): a forward without
adapter terms, no second model. A forward pass of the policy (a pruned branch) runs the adapters.

Two views of the same step:

- ``ideal``: only real tokens are executed (no padding), attention is causal within each
  sequence, the head projects the scored rows (selective) or every real token (baseline). This is
  the physical limit a perfect kernel would reach.
- ``padded``: the shapes the schedule actually runs: every row padded to its microbatch's
  length (the pass's longest row under pipeline parallelism, whose stages agree on one), causal
  attention over the whole row (the block-diagonal concat mask still computes the full row), the
  baseline head over every padded position, and the selective head's backward recomputing its
  logits (one more head forward). Measured / padded shows the
  efficiency of the executed work; padded / ideal shows what padding and recompute cost.

Memory (``padded`` view only, rough): a training microbatch stores per token and layer about
``4h + 3q + 4kv + 4ffn`` activations, less ``q + kv`` with query/key norms (the local spec's
RMSNorm and SwiGLU keep only their inputs; a MoE layer: ``5 * top_k * expert_ffn``, Megatron's
own activation, plus the router's probabilities and the token's permuted copies) plus ``2 * heads * seq_length`` attention
scores/probs (the unfused local attention keeps them), or only the layer input under full
recompute plus one layer's working set; a forward-only microbatch keeps one layer's working set
(residual stream plus the larger of attention and MLP intermediates); the baseline head holds one fp32 ``rows x vocab``
tensor (Megatron's cross entropy turns the logits into softmax and then into their gradient in
place; half-precision logits add their own copy), the fused selective head one chunk;
a training microbatch also holds the head weight's gradient before it reaches the grad buffer
(an unfused Adam would add two fp32 temporaries of the largest parameter). Step peak = the
largest of these (microbatches run one after another at PP = 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""The linears LoRA adapts by default (every linear of attention and MLP)."""


@dataclass(frozen=True, kw_only=True)
class Shape:
    """Widths of a decoder-only transformer (RMSNorm, SwiGLU, GQA)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    """Vocabulary the head projects onto (the padded embedding size)."""
    moe_layers: int = 0
    """Layers whose MLP is a mixture of experts (the other ``layers - moe_layers`` keep the dense
    MLP of width ``ffn``); 0 for a dense model."""
    num_experts: int = 0
    """Routed experts per MoE layer (the router's output width)."""
    top_k: int = 0
    """Experts each token runs in a MoE layer."""
    expert_ffn: int = 0
    """SwiGLU inner width of one expert."""
    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys (Qwen3): two more norm weights per layer."""
    tied_embeddings: bool = False
    """The output layer shares the input embedding's weight (one ``vocab x hidden`` matrix)."""

    def __post_init__(self) -> None:
        if not 0 <= self.moe_layers <= self.layers:
            raise ValueError(f"moe_layers must be in 0..layers ({self.layers}), got {self.moe_layers}")
        if self.moe_layers and not (1 <= self.top_k <= self.num_experts and self.expert_ffn > 0):
            raise ValueError(f"a MoE shape needs 1 <= top_k <= num_experts and expert_ffn > 0, got top_k={self.top_k}, "
                             f"num_experts={self.num_experts}, expert_ffn={self.expert_ffn}")

    @classmethod
    def from_arch(cls, arch, *, vocab: int | None = None) -> "Shape":
        """From a :class:`megatron_prune.model.arch.ModelArch` (or a dict of its fields)."""
        if isinstance(arch, dict):
            from megatron_prune.model.arch import ModelArch

            arch = ModelArch.from_dict(arch)
        moe = {}
        if arch.is_moe:
            moe = dict(moe_layers=sum(arch.moe_layer_pattern()), num_experts=arch.num_experts,
                       top_k=arch.num_experts_per_tok, expert_ffn=arch.moe_intermediate_size)
        return cls(hidden=arch.hidden_size, layers=arch.num_layers, heads=arch.num_attention_heads,
                   kv_heads=arch.num_key_value_heads, head_dim=arch.head_dim, ffn=arch.intermediate_size,
                   vocab=vocab or arch.vocab_size, qk_norm=arch.qk_norm,
                   tied_embeddings=arch.tie_word_embeddings, **moe)

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def attention_params(self) -> int:
        """Matmul parameters of one layer's attention (q/k/v and output projections)."""
        return self.hidden * (self.q_width + 2 * self.kv_width) + self.q_width * self.hidden

    def layer_params(self) -> int:
        """Matmul parameters of one dense transformer layer."""
        return self.attention_params() + 3 * self.hidden * self.ffn

    def moe_layer_active_params(self) -> int:
        """Matmul parameters one token runs through in one MoE layer: attention, the router and
        its ``top_k`` experts."""
        return self.attention_params() + self.hidden * self.num_experts + self.top_k * 3 * self.hidden * self.expert_ffn

    def active_params(self) -> int:
        """Matmul parameters one token runs through in the whole body (all layers)."""
        return self.layer_params() * self.dense_layers + self.moe_layer_active_params() * self.moe_layers

    def param_count(self) -> int:
        """Every weight of the model: embedding and output layer (one matrix when tied), each
        layer's matmuls (all experts of a MoE layer, and its router), its norms, the final norm."""
        norms = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        moe_mlp = self.hidden * self.num_experts + self.num_experts * 3 * self.hidden * self.expert_ffn
        layers = (self.attention_params() + norms) * self.layers + 3 * self.hidden * self.ffn * self.dense_layers \
            + moe_mlp * self.moe_layers
        return (1 if self.tied_embeddings else 2) * self.vocab * self.hidden + layers + self.hidden

    def body_flops_per_token(self) -> float:
        return 2.0 * self.active_params()

    def attention_flops(self, attended_pairs: float) -> float:
        """Attention core (QK^T and AV) over ``attended_pairs`` (query, key) pairs, all layers."""
        return 4.0 * self.q_width * self.layers * attended_pairs

    def head_flops(self, rows: float) -> float:
        return 2.0 * self.hidden * self.vocab * rows

    def adapter_params(self, rank: int, targets: tuple[str, ...] = LORA_TARGETS) -> int:
        """LoRA parameters of one dense layer: ``rank * (in + out)`` per adapted linear."""
        return self._adapter_params(rank, targets, ffn=self.ffn, mlp_copies=1)

    def _adapter_params(self, rank: int, targets: tuple[str, ...], *, ffn: int, mlp_copies: int) -> int:
        widths = {"linear_qkv": (self.hidden, self.q_width + 2 * self.kv_width),
                  "linear_proj": (self.q_width, self.hidden),
                  "linear_fc1": (self.hidden, 2 * ffn),
                  "linear_fc2": (ffn, self.hidden)}
        unknown = [t for t in targets if t not in widths]
        if unknown:
            raise ValueError(f"unknown LoRA target(s) {unknown}; choose from {list(widths)}")
        return sum(rank * (widths[t][0] + widths[t][1]) * (mlp_copies if t in ("linear_fc1", "linear_fc2") else 1)
                   for t in targets)

    def adapter_param_count(self, rank: int, targets: tuple[str, ...] = LORA_TARGETS) -> int:
        """LoRA parameters of the whole model (a MoE layer: one adapter per expert on its MLP linears)."""
        moe = self._adapter_params(rank, targets, ffn=self.expert_ffn, mlp_copies=self.num_experts)
        return self.adapter_params(rank, targets) * self.dense_layers + moe * self.moe_layers

    def adapter_activations_per_token(self, rank: int, targets: tuple[str, ...] = LORA_TARGETS) -> float:
        """Rank-r activations (``x A^T``, kept for ``B``'s gradient) one token stores per layer,
        averaged over layers (a MoE layer: its ``top_k`` experts' MLP adapters)."""
        mlp = sum(t in ("linear_fc1", "linear_fc2") for t in targets)
        attention = len(targets) - mlp
        return rank * (attention + mlp * (self.dense_layers + self.top_k * self.moe_layers) / self.layers)

    def recomputed_norm_outputs_per_token(self) -> float:
        """Normalised inputs per token and layer (two RMSNorms, plus the query and key norms) that
        the local spec's RMSNorm recomputes in its backward instead of keeping."""
        return 2 * self.hidden + (self.q_width + self.kv_width if self.qk_norm else 0)

    def adapter_flops_per_token(self, rank: int, targets: tuple[str, ...] = LORA_TARGETS) -> float:
        """Forward FLOPs of the adapters per token, all layers (``x A^T`` then ``B``); in a MoE
        layer a token runs the adapters of its ``top_k`` experts."""
        moe = self._adapter_params(rank, targets, ffn=self.expert_ffn, mlp_copies=self.top_k)
        return 2.0 * (self.adapter_params(rank, targets) * self.dense_layers + moe * self.moe_layers)

    def mlp_activation_width(self) -> float:
        """Per token, the MLP's inner width averaged over layers (a MoE layer: its top-k experts')."""
        return (self.ffn * self.dense_layers + self.top_k * self.expert_ffn * self.moe_layers) / self.layers

    def moe_dispatch_width(self) -> float:
        """Per token, averaged over layers: what a MoE layer holds besides its experts' MLPs (router
        logits and probabilities; the token's top-k permuted copies in and out)."""
        return (2 * self.num_experts + 2 * self.top_k * self.hidden) * self.moe_layers / self.layers


@dataclass(kw_only=True)
class Microbatch:
    """One microbatch: rows of packed sequences, padded to ``seq_length``."""

    rows: list[list[int]]
    """Sequence lengths (prompt + response) packed in each row."""
    seq_length: int
    """Padded row length the schedule runs."""
    scored: int
    """Positions the selective head scores (response positions after position pruning)."""
    selective: bool = True
    """False: the baseline head projects every position onto the vocabulary."""
    prefixes: list[list[int]] | None = None
    """Per row and sequence, the keys of a shared prefix earlier in the row that the sequence's
    queries also attend to (the shared DPO layout ``[prompt, chosen, rejected]``: rows
    ``[P, C, R]``, prefixes ``[0, P, P]``); None: every sequence attends only to itself."""

    @property
    def tokens(self) -> int:
        return sum(sum(r) for r in self.rows)

    @property
    def padded_tokens(self) -> int:
        return len(self.rows) * self.seq_length

    @property
    def attention_keys(self) -> float:
        """Keys per query that the memory model charges attention scores for: the row length for
        dense causal rows (``prefixes`` None); with segment attention (``prefixes`` given), the
        mean over the padded positions of each query's own causal keys plus its prefix (a padding
        position sees itself), so packing rows end to end does not make every query pay for the
        whole row."""
        if self.prefixes is None:
            return float(self.seq_length)
        keys = sum(n * p + _causal_pairs(n) for row, prefixes in zip(self.rows, self.prefixes)
                   for n, p in zip(row, prefixes))
        return (keys + self.padded_tokens - self.tokens) / self.padded_tokens


@dataclass(kw_only=True)
class Pass:
    """One schedule call: ``train`` (forward + backward) or ``forward`` (no_grad)."""

    kind: str
    microbatches: list[Microbatch] = field(default_factory=list)
    adapters: bool = True
    """Under LoRA: False for the reference pass (the policy with its adapters off)."""

    def __post_init__(self) -> None:
        if self.kind not in ("train", "forward"):
            raise ValueError(f"pass kind must be 'train' or 'forward', got {self.kind!r}")


def _causal_pairs(n: int) -> float:
    return n * (n + 1) / 2.0


def forward_flops(shape: Shape, mb: Microbatch, *, view: str = "ideal") -> dict[str, float]:
    """Body and head forward FLOPs of one microbatch in ``view`` (ideal or padded)."""
    if view == "ideal":
        tokens = mb.tokens
        pairs = sum(_causal_pairs(n) for r in mb.rows for n in r)
        if mb.prefixes is not None:  # attention per segment: its prefix plus its own causal keys
            pairs += sum(n * k for r, ks in zip(mb.rows, mb.prefixes) for n, k in zip(r, ks))
    elif view == "padded":
        tokens = mb.padded_tokens
        pairs = len(mb.rows) * _causal_pairs(mb.seq_length)
    else:
        raise ValueError(f"view must be 'ideal' or 'padded', got {view!r}")
    head_rows = mb.scored if mb.selective else tokens
    attention = shape.attention_flops(pairs)
    return {"body": shape.body_flops_per_token() * tokens + attention, "head": shape.head_flops(head_rows),
            "attention": attention, "tokens": float(tokens)}


def step_flops(shape: Shape, passes: list[Pass], *, recompute: bool = False, view: str = "ideal",
               lora_rank: int = 0, lora_targets: tuple[str, ...] = LORA_TARGETS) -> dict[str, float]:
    """FLOPs of a step split by pass kind and part; ``total`` is their sum. ``lora_rank > 0``:
    a LoRA step (frozen base, adapter terms in the body, adapter-off reference)."""
    if lora_rank:
        return _lora_step_flops(shape, passes, recompute=recompute, view=view, rank=lora_rank, targets=lora_targets)
    out = {"train_body": 0.0, "train_head": 0.0, "forward_body": 0.0, "forward_head": 0.0}
    for p in passes:
        for mb in p.microbatches:
            f = forward_flops(shape, mb, view=view)
            if p.kind == "forward":
                out["forward_body"] += f["body"]
                out["forward_head"] += f["head"]
                continue
            out["train_body"] += f["body"] * (4.0 if recompute else 3.0)
            # The fused selective op recomputes its logits in backward (padded view only).
            head_factor = 4.0 if (view == "padded" and mb.selective) else 3.0
            out["train_head"] += f["head"] * head_factor
    out["total"] = sum(out.values())
    return out


def _lora_step_flops(shape: Shape, passes: list[Pass], *, recompute: bool, view: str, rank: int,
                     targets: tuple[str, ...]) -> dict[str, float]:
    out = {"train_body": 0.0, "train_head": 0.0, "forward_body": 0.0, "forward_head": 0.0}
    for p in passes:
        for mb in p.microbatches:
            f = forward_flops(shape, mb, view=view)
            adapter = shape.adapter_flops_per_token(rank, targets) * f["tokens"] if p.adapters else 0.0
            if p.kind == "forward":
                out["forward_body"] += f["body"] + adapter
                out["forward_head"] += f["head"]
                continue
            weights = f["body"] - f["attention"]
            # forward + dX of the weight matmuls (no dW), forward + two input gradients of the
            # attention core, forward + dX + dW of the adapters; full recompute: one more forward.
            out["train_body"] += 2.0 * weights + 3.0 * f["attention"] + 3.0 * adapter
            if recompute:
                out["train_body"] += f["body"] + adapter
            # The head is frozen too: forward + dX (the fused selective op recomputes its logits).
            out["train_head"] += f["head"] * (3.0 if (view == "padded" and mb.selective) else 2.0)
    out["total"] = sum(out.values())
    return out


def activation_elements_per_token_layer(shape: Shape, seq_length: float) -> float:
    """Stored activations of one token in one layer (no recompute), unfused local attention
    (scores and probabilities over ``seq_length`` keys)."""
    recomputed_silu = shape.ffn * shape.dense_layers / shape.layers  # the dense layers' SwiGLU keeps only fc1's output
    return (6 * shape.hidden + 3 * shape.q_width + 4 * shape.kv_width + 5 * shape.mlp_activation_width()
            - shape.recomputed_norm_outputs_per_token() - recomputed_silu
            + shape.moe_dispatch_width() + 2 * shape.heads * seq_length)


def forward_working_set_per_token(shape: Shape, seq_length: float) -> float:
    """Live elements per token while a no-grad pass runs one layer: the residual stream and its
    norm, plus the larger of the attention block (q, k, v, output, scores and probs) and the MLP
    (gate, up and activation; a MoE layer: its top-k experts' and the dispatch copies)."""
    attention = 2 * shape.q_width + 2 * shape.kv_width + 2 * shape.heads * seq_length
    mlp = 3 * shape.ffn if shape.dense_layers else 0
    if shape.moe_layers:
        mlp = max(mlp, 3 * shape.top_k * shape.expert_ffn + 2 * shape.num_experts + 2 * shape.top_k * shape.hidden)
    return 2 * shape.hidden + max(attention, mlp)


def step_peak_bytes(shape: Shape, passes: list[Pass], *, recompute: bool = False, bytes_per_elem: int = 4,
                    head_chunk: int = 4096, optimizer_temporaries: int = 0, lora_rank: int = 0,
                    lora_targets: tuple[str, ...] = LORA_TARGETS) -> float:
    """Rough peak of the step's own memory: the largest of its microbatches and its optimizer update.

    A training microbatch holds its activations and logits plus the head weight's gradient
    (``vocab x hidden``, produced by autograd before it is added into the persistent grad
    buffer). The optimizer update holds ``optimizer_temporaries`` fp32 copies of the largest
    parameter: 0 for a fused Adam (TE, Apex, or torch's fused kernel, which ``build_optimizer``
    selects), 2 for torch's for-loop AdamW (``sqrt`` and ``div`` of ``exp_avg_sq``).
    Weights, gradient buffers and optimizer state are the baseline, not counted.

    Under LoRA (``lora_rank > 0``) a training microbatch also keeps each adapter's rank-r
    activation, and no head weight gradient (the head is frozen); the adapters' own parameters are
    too small to be the optimizer's largest.
    """
    largest_param = shape.vocab * shape.hidden
    peak = optimizer_temporaries * largest_param * 4.0 if not lora_rank else 0.0
    lora_per_token = shape.adapter_activations_per_token(lora_rank, lora_targets) if lora_rank else 0.0
    for p in passes:
        for mb in p.microbatches:
            per_layer = (activation_elements_per_token_layer(shape, mb.attention_keys) + lora_per_token) * mb.padded_tokens
            if p.kind == "train":
                acts = (shape.layers * shape.hidden * mb.padded_tokens + per_layer) if recompute \
                    else shape.layers * per_layer
                acts += 0 if lora_rank else largest_param
            else:
                acts = forward_working_set_per_token(shape, mb.attention_keys) * mb.padded_tokens
            if mb.selective:
                head = mb.scored * (min(head_chunk, shape.vocab) * 2 + shape.hidden * 2) * bytes_per_elem
            else:
                # Megatron's vocab-parallel cross entropy keeps fp32 softmax in place of the logits
                # and writes its gradient over it; half-precision logits are an extra copy.
                head = mb.padded_tokens * shape.vocab * (4 + (bytes_per_elem if bytes_per_elem != 4 else 0))
            peak = max(peak, acts * bytes_per_elem + head)
    return peak


def state_bytes(shape: Shape, *, lora_rank: int = 0, lora_targets: tuple[str, ...] = LORA_TARGETS,
                param_bytes: int = 4, online_reference: bool = True) -> float:
    """Persistent training memory of one unsharded replica (TP = PP = DP = 1, no distributed optimizer).

    Megatron with Adam keeps, per trained parameter, the weight (``param_bytes``), an fp32
    gradient buffer (4), an fp32 main copy when the weights are in half precision (4) and two
    fp32 moments (8): 16 bytes in fp32, 18 in bf16; an online reference adds a second copy of the
    weights. Under LoRA only the adapters train: the frozen base is stored once (``param_bytes``
    each) and serves as the adapter-off reference, so there is no second copy.
    """
    per_trained = param_bytes + 4 + (4 if param_bytes < 4 else 0) + 8
    weights = shape.param_count()
    if lora_rank:
        return weights * param_bytes + shape.adapter_param_count(lora_rank, lora_targets) * per_trained
    return weights * per_trained + (weights * param_bytes if online_reference else 0)


def head_share(shape: Shape, seq_length: int) -> float:
    """Share of the head in the forward FLOPs of one full causal row of ``seq_length`` tokens."""
    mb = Microbatch(rows=[[seq_length]], seq_length=seq_length, scored=seq_length)
    f = forward_flops(shape, mb, view="ideal")
    return f["head"] / (f["head"] + f["body"])


def passes_from_dict(data: list[dict]) -> list[Pass]:
    """Inverse of :func:`passes_to_dict` (the benchmark's JSON records)."""
    return [Pass(kind=p["kind"], microbatches=[Microbatch(**mb) for mb in p["microbatches"]],
                 adapters=p.get("adapters", True)) for p in data]


def passes_to_dict(passes: list[Pass]) -> list[dict]:
    return [{"kind": p.kind, "microbatches": [dict(rows=mb.rows, seq_length=mb.seq_length, scored=mb.scored,
                                                    selective=mb.selective,
                                                    **({} if mb.prefixes is None else {"prefixes": mb.prefixes}))
                                               for mb in p.microbatches],
             **({} if p.adapters else {"adapters": False})}
            for p in passes]


if __name__ == "__main__":  # a library of tools/bench_dpo.py: say so instead of exiting silently
    print(f"{__doc__.strip()}\n\nThis file is a library of tools/bench_dpo.py, which prints these figures beside the "
          "measured ones; run: python tools/bench_dpo.py --help")
