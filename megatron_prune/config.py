"""Every knob of the trainers, as validated dataclasses (the single source of flags and docs).

Each field's docstring is its ``--help`` text; ``metadata["flag"]`` pins the command-line name
where it is not simply ``--field-name``. :mod:`megatron_prune.arguments` builds the argparse
groups from these classes.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import os
import textwrap
from dataclasses import dataclass, field
from typing import Any

MODEL_PRESETS = ("tiny", "tiny-tied", "tiny-moe")
"""Names accepted by --model-preset (megatron_prune.model.arch.PRESETS; kept here so that the flags
need no model code)."""


def _flag(name: str, **extra) -> dict:
    return {"flag": name, **extra}


def flag_of(f: dataclasses.Field) -> str:
    """The command-line name of a config field."""
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """Map each dataclass field to the string literal that follows it in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
RECOMPUTE_MODULES = ("core_attn", "mlp", "moe")  # Megatron's "layernorm" needs Transformer Engine
FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
"""Megatron's TransformerConfig fields of --recompute-activations: every layer, one at a time."""


@dataclass(kw_only=True)
class ModelConfig:
    """Where the model comes from and how it is laid out."""

    model_preset: str | None = field(default=None, metadata=_flag("--model-preset", choices=MODEL_PRESETS))
    """Tiny random-weight model (tiny: 4 Qwen3-shaped layers; tiny-tied: the same with tied embeddings;
    tiny-moe: Qwen3-MoE-shaped, 4 experts top-2, layer 0 dense), with its bundled tokenizer; identical at
    every layout."""
    hf_model: str | None = field(default=None, metadata=_flag("--hf-model"))
    """Local HF model directory (config.json + safetensors): architecture, weights and tokenizer."""
    tokenizer: str | None = field(default=None, metadata=_flag("--tokenizer"))
    """Tokenizer: 'tiny', a SentencePiece .model file or an HF tokenizer directory (defaults from the model;
    GRPO's toy tasks use none)."""
    chat_template_kwargs: str | None = field(default=None, metadata=_flag("--chat-template-kwargs"))
    """JSON object of extra variables for the tokenizer's chat template, for every prompt and response it
    renders, e.g. '{"enable_thinking": false}' for Qwen3's non-thinking mode (as the keyword arguments of
    transformers' apply_chat_template)."""
    tensor_model_parallel_size: int = field(default=1, metadata=_flag("--tensor-model-parallel-size"))
    """Tensor-parallel ranks."""
    pipeline_model_parallel_size: int = field(default=1, metadata=_flag("--pipeline-model-parallel-size"))
    """Pipeline stages."""
    virtual_pipeline_model_parallel_size: int | None = field(
        default=None, metadata=_flag("--virtual-pipeline-model-parallel-size")
    )
    """Model chunks per pipeline rank (interleaved 1F1B)."""
    sequence_parallel: bool = field(default=False, metadata=_flag("--sequence-parallel"))
    """Sequence parallelism in TP regions (needs TP > 1)."""
    bf16: bool = field(default=False, metadata=_flag("--bf16"))
    """bfloat16 parameters and activations, fp32 main weights."""
    recompute: bool = field(default=False, metadata=_flag("--recompute-activations"))
    """Full activation recomputation of every layer (trades compute for memory): the same as
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1. (Megatron-LM's
    flag of this name selects selective recompute: here that is --recompute-granularity selective.)"""
    recompute_granularity: str | None = field(
        default=None, metadata=_flag("--recompute-granularity", choices=RECOMPUTE_GRANULARITIES))
    """Megatron's activation recompute: full reruns whole layers in the backward (which and how many:
    --recompute-method, --recompute-num-layers); selective reruns only the parts named by --recompute-modules."""
    recompute_method: str | None = field(default=None, metadata=_flag("--recompute-method", choices=RECOMPUTE_METHODS))
    """With --recompute-granularity full: uniform recomputes every layer, in chunks of --recompute-num-layers
    layers; block recomputes only the first --recompute-num-layers layers of each pipeline stage (of each model
    chunk under --virtual-pipeline-model-parallel-size) (default: uniform)."""
    recompute_num_layers: int | None = field(default=None, metadata=_flag("--recompute-num-layers"))
    """With --recompute-granularity full: layers per recomputed chunk (uniform) or recomputed layers per
    pipeline stage or model chunk (block) (default: 1)."""
    recompute_modules: list[str] | None = field(
        default=None, metadata=_flag("--recompute-modules", nargs="+", choices=RECOMPUTE_MODULES))
    """With --recompute-granularity selective: the parts of each layer to recompute (Megatron's names: core_attn,
    the attention's scores, softmax and context; mlp, a dense layer's MLP; moe, a MoE layer's router and
    experts) (default: core_attn)."""
    use_distributed_optimizer: bool = field(default=False, metadata=_flag("--use-distributed-optimizer"))
    """Shard optimizer state over data-parallel ranks."""
    expert_model_parallel_size: int = field(default=1, metadata=_flag("--expert-model-parallel-size"))
    """Expert-parallel ranks of a mixture-of-experts model (Qwen3-MoE): each holds num_experts / EP experts
    of every MoE layer; must divide the data-parallel size."""
    moe_token_dispatcher: str = field(
        default="alltoall", metadata=_flag("--moe-token-dispatcher", choices=("alltoall", "allgather"))
    )
    """How a MoE layer sends tokens to the ranks holding their experts (Megatron's token dispatchers)."""
    moe_aux_loss_coeff: float = field(default=0.0, metadata=_flag("--moe-aux-loss-coeff"))
    """Router load-balancing loss coefficient of a MoE model, added to the training pass's loss (0 = off);
    reported as moe_aux_loss."""
    moe_z_loss_coeff: float = field(default=0.0, metadata=_flag("--moe-z-loss-coeff"))
    """Router z-loss coefficient of a MoE model, added to the training pass's loss (0 = off); reported as
    moe_z_loss."""
    device: str = field(default="auto", metadata=_flag("--device", choices=("auto", "cuda", "npu", "cpu")))
    """Accelerator (auto: npu if present, else cuda if present, else cpu)."""

    def __post_init__(self) -> None:
        if self.chat_template_kwargs is not None:
            from megatron_prune.data.tokenizer import parse_chat_template_kwargs

            parse_chat_template_kwargs(self.chat_template_kwargs)
        if self.recompute and self.recompute_granularity is not None:
            raise ValueError("give one of --recompute-activations (full recompute of every layer) and "
                             "--recompute-granularity, not both")
        if self.recompute_granularity != "full":
            for name in ("recompute_method", "recompute_num_layers"):
                if getattr(self, name) is not None:
                    raise ValueError(f"--{name.replace('_', '-')} needs --recompute-granularity full")
        if self.recompute_granularity != "selective" and self.recompute_modules is not None:
            raise ValueError("--recompute-modules needs --recompute-granularity selective")
        if self.recompute_num_layers is not None and self.recompute_num_layers < 1:
            raise ValueError(f"--recompute-num-layers must be >= 1, got {self.recompute_num_layers}")

    @property
    def chat_template_args(self) -> dict[str, Any]:
        """The variables of ``--chat-template-kwargs`` ({} when not given)."""
        from megatron_prune.data.tokenizer import parse_chat_template_kwargs

        return parse_chat_template_kwargs(self.chat_template_kwargs) if self.chat_template_kwargs else {}

    @property
    def recompute_kwargs(self) -> dict:
        """Megatron's TransformerConfig fields for the recompute these flags ask for (empty: none)."""
        if self.recompute:
            return dict(FULL_RECOMPUTE)
        if self.recompute_granularity == "full":
            return {**FULL_RECOMPUTE, **{k: v for k, v in (("recompute_method", self.recompute_method),
                                                            ("recompute_num_layers", self.recompute_num_layers))
                                        if v is not None}}
        if self.recompute_granularity == "selective":
            return dict(recompute_granularity="selective", recompute_modules=list(self.recompute_modules or ["core_attn"]))
        return {}


MAX_TIMEOUT_MINUTES = 10_000_000
"""Largest --distributed-timeout-minutes: a deadline the collectives' clocks can still hold."""


@dataclass(kw_only=True)
class TrainConfig:
    """Schedule, batch and optimizer."""

    train_iters: int = field(default=10, metadata=_flag("--train-iters"))
    """Optimizer steps to run."""
    global_batch_size: int = field(default=8, metadata=_flag("--global-batch-size"))
    """Samples per optimizer step over all DP ranks: DPO pairs; in GRPO the prompts of a rollout
    (each of its --minibatches optimizer steps trains 1/--minibatches of them)."""
    micro_batch_size: int = field(default=1, metadata=_flag("--micro-batch-size"))
    """Samples per microbatch per DP rank: DPO pairs; in GRPO the rows of a training or scoring
    pass (a completion, a packed row of several, or a prompt's group with --shared-prompt)."""
    seq_length: int = field(default=1024, metadata=_flag("--seq-length"))
    """Maximum tokens of one sequence (prompt + response)."""
    max_prompt_length: int | None = field(default=None, metadata=_flag("--max-prompt-length"))
    """Longer prompts are cut from the left to this many tokens, keeping BOS and the chat template's head
    (default: DPO, no separate limit; GRPO, --seq-length minus --max-new-tokens; GRPO's toy tasks use
    --toy-prompt-length instead)."""
    lr: float = field(default=1e-6, metadata=_flag("--lr"))
    """Peak learning rate."""
    min_lr: float = field(default=0.0, metadata=_flag("--min-lr"))
    """Final learning rate of the decay (unused by --lr-decay-style constant)."""
    lr_warmup_iters: int = field(default=0, metadata=_flag("--lr-warmup-iters"))
    """Linear warm-up steps (below --train-iters, or the rate never reaches --lr)."""
    lr_decay_style: str = field(default="constant", metadata=_flag("--lr-decay-style", choices=("constant", "linear", "cosine")))
    """Learning-rate decay after warm-up."""
    override_opt_param_scheduler: bool = field(
        default=False, metadata=_flag("--override-opt-param-scheduler", aliases=("--override-opt_param-scheduler",))
    )
    """Resuming: run this launch's learning-rate schedule (--lr, --min-lr, --lr-warmup-iters, --lr-decay-style,
    --weight-decay, and --train-iters as the decay horizon) from the checkpoint's step count on, instead of the
    checkpoint's schedule (Megatron's flag; e.g. to extend a decaying run)."""
    optimizer: str = field(default="adam", metadata=_flag("--optimizer", choices=("adam", "sgd")))
    """Optimizer: adam (Adam with decoupled weight decay) or sgd (Megatron's SGD, with --sgd-momentum)."""
    weight_decay: float = field(default=0.0, metadata=_flag("--weight-decay"))
    """Decoupled weight decay."""
    adam_beta1: float = field(default=0.9, metadata=_flag("--adam-beta1"))
    """Adam beta1 (--optimizer adam only)."""
    adam_beta2: float = field(default=0.95, metadata=_flag("--adam-beta2"))
    """Adam beta2 (--optimizer adam only)."""
    adam_eps: float = field(default=1e-8, metadata=_flag("--adam-eps"))
    """Adam epsilon, added to the second moment's square root (--optimizer adam only)."""
    sgd_momentum: float = field(default=0.9, metadata=_flag("--sgd-momentum"))
    """Momentum of --optimizer sgd (Megatron's default 0.9; 0 = plain SGD)."""
    clip_grad: float = field(default=1.0, metadata=_flag("--clip-grad"))
    """Gradient-norm clip (0 = off)."""
    seed: int = field(default=1234, metadata=_flag("--seed"))
    """Seed of weights (presets), data order and every pruning draw."""
    on_nonfinite: str = field(default="stop", metadata=_flag("--on-nonfinite", choices=("stop", "skip")))
    """A NaN/Inf loss or gradient: stop the run naming the step, or skip the step (10 skipped in a row stop the run)."""
    distributed_timeout_minutes: float = field(default=10.0, metadata=_flag("--distributed-timeout-minutes"))
    """Collective timeout (at most 1e7 minutes); a rank that waits longer ends the run with an error naming itself."""

    def __post_init__(self) -> None:
        for name in ("train_iters", "global_batch_size", "micro_batch_size", "seq_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("lr", "min_lr", "weight_decay", "clip_grad", "adam_beta1", "adam_beta2", "adam_eps",
                     "sgd_momentum", "distributed_timeout_minutes"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number, got {getattr(self, name)}")
        if not -2**62 <= self.seed < 2**62:  # torch seeds are 64-bit; ranks add small offsets to it
            raise ValueError(f"--seed must be in [-2**62, 2**62), got {self.seed}")
        if self.lr < 0 or self.min_lr < 0:
            raise ValueError("--lr and --min-lr must be >= 0")
        if self.min_lr > self.lr:
            raise ValueError(f"--min-lr {self.min_lr} must be <= --lr {self.lr} (the decay goes from --lr down to it)")
        if self.max_prompt_length is not None and not 1 <= self.max_prompt_length < self.seq_length:
            raise ValueError(f"--max-prompt-length must be in [1, --seq-length {self.seq_length}), got "
                             f"{self.max_prompt_length}: a prompt needs room for its response")
        if self.lr_warmup_iters < 0:
            raise ValueError(f"--lr-warmup-iters must be >= 0, got {self.lr_warmup_iters}")
        if self.weight_decay < 0:
            raise ValueError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(self, name)}")
        if self.adam_eps <= 0:
            raise ValueError(f"--adam-eps must be > 0, got {self.adam_eps}")
        if self.clip_grad < 0:
            raise ValueError(f"--clip-grad must be >= 0, got {self.clip_grad}")
        if not 0.0 <= self.sgd_momentum < 1.0:
            raise ValueError(f"--sgd-momentum must be in [0, 1), got {self.sgd_momentum}")
        if self.distributed_timeout_minutes <= 0:
            raise ValueError(f"--distributed-timeout-minutes must be > 0, got {self.distributed_timeout_minutes}")
        if self.distributed_timeout_minutes > MAX_TIMEOUT_MINUTES:
            # Python's timedelta overflows near 1.4e12 minutes, and the collectives' deadlines (now + timeout,
            # in int64 nanoseconds) near 1.5e8.
            raise ValueError(f"--distributed-timeout-minutes must be at most {MAX_TIMEOUT_MINUTES} (about 19 years), "
                             f"got {self.distributed_timeout_minutes}")


EXIT_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2")
"""What --exit-signal accepts (SIGINT stays Ctrl-C: stop at once, no save)."""


@dataclass(kw_only=True)
class CheckpointConfig:
    """Saving and resuming."""

    save: str | None = field(default=None, metadata=_flag("--save"))
    """Directory for checkpoints (atomic; resumable at any layout)."""
    save_interval: int | None = field(default=None, metadata=_flag("--save-interval"))
    """Save every N steps and at the end (default: only at the end)."""
    load: str | None = field(default=None, metadata=_flag("--load"))
    """Resume from the newest complete checkpoint here (a converted model loads weights only)."""
    finetune: bool = field(default=False, metadata=_flag("--finetune"))
    """Load only the weights from --load (start at step 0 with a fresh optimizer); they are also the reference (for a LoRA checkpoint: its base, adapters off)."""
    exit_signal_handler: bool = field(default=False, metadata=_flag("--exit-signal-handler"))
    """On --exit-signal (a scheduler's preemption or time-limit warning), finish the current step, save a
    checkpoint and stop with exit code 0; the ranks agree at each step's end, so one rank's signal stops all
    (under torchrun raise its --shutdown-timeout above one step and one save)."""
    exit_signal: str = field(default="SIGTERM", metadata=_flag("--exit-signal", choices=EXIT_SIGNALS))
    """The signal --exit-signal-handler catches; torchrun forwards SIGTERM to every rank, SIGUSR1/2 only when
    listed in TORCHELASTIC_SIGNALS_TO_HANDLE (else the signal ends the agent)."""
    exit_duration_in_mins: float | None = field(default=None, metadata=_flag("--exit-duration-in-mins"))
    """Stop after the first step that ends this many minutes after launch, saving a checkpoint there if --save
    is given (keep a margin below the job's time limit for one step and one save)."""
    exit_interval: int | None = field(default=None, metadata=_flag("--exit-interval"))
    """Stop after the first step whose number is a multiple of N, saving a checkpoint there if --save is given."""

    def __post_init__(self) -> None:
        if self.save_interval is not None and self.save_interval < 1:
            raise ValueError(f"--save-interval must be >= 1, got {self.save_interval}")
        if self.save_interval is not None and self.save is None:
            raise ValueError("--save-interval needs --save")
        if self.exit_signal_handler and self.save is None:
            raise ValueError("--exit-signal-handler needs --save (where the checkpoint goes before the run stops)")
        if self.exit_duration_in_mins is not None and not (math.isfinite(self.exit_duration_in_mins)
                                                           and self.exit_duration_in_mins > 0):
            raise ValueError(f"--exit-duration-in-mins must be a number > 0, got {self.exit_duration_in_mins}")
        if self.exit_interval is not None and self.exit_interval < 1:
            raise ValueError(f"--exit-interval must be >= 1, got {self.exit_interval}")
        if self.finetune and self.load is None:
            raise ValueError("--finetune needs --load (the checkpoint whose weights to start from)")
        for flag, path in (("--save", self.save), ("--load", self.load)):
            if path is not None and os.path.exists(path) and not os.path.isdir(path):
                raise ValueError(f"{flag} {path}: exists and is not a directory")


@dataclass(kw_only=True)
class LoggingConfig:
    """Metrics and console output."""

    metrics_jsonl: str | None = field(default=None, metadata=_flag("--metrics-jsonl"))
    """Write one JSON object per step here (from one rank)."""
    tensorboard_dir: str | None = field(default=None, metadata=_flag("--tensorboard-dir"))
    """TensorBoard event directory (needs the tensorboard package: pip install tensorboard)."""
    log_interval: int = field(default=1, metadata=_flag("--log-interval"))
    """Console progress line at steps N, 2N, ... (counted from 1), and at the run's first and last step
    (the metrics file and TensorBoard get every step)."""

    def __post_init__(self) -> None:
        if self.log_interval < 1:
            raise ValueError(f"--log-interval must be >= 1, got {self.log_interval}")
        if self.metrics_jsonl is not None and os.path.isdir(self.metrics_jsonl):
            raise ValueError(f"--metrics-jsonl {self.metrics_jsonl}: is a directory; give a file path")
        if self.tensorboard_dir is not None and os.path.exists(self.tensorboard_dir) \
                and not os.path.isdir(self.tensorboard_dir):
            raise ValueError(f"--tensorboard-dir {self.tensorboard_dir}: exists and is not a directory")


PRUNE_PRESETS: dict[str, dict[str, float | bool]] = {
    "study": {"position_ratio": 0.6, "seq_min_ratio": 0.5, "branch": True, "branch_chosen_prob": 0.5},
}
"""Named pruning settings for --prune-preset; a --prune-* flag given with it overrides its value."""
PRUNE_OFF: dict[str, float | bool] = {"position_ratio": 1.0, "seq_min_ratio": 1.0, "branch": False,
                                      "branch_chosen_prob": 0.5}
"""The defaults: every stochastic pruning off (exact DPO)."""


@dataclass(kw_only=True)
class PruneConfig:
    """DPO graph pruning (method and bias: docs/dpo.md). Default: exact DPO, only the exact selective head on."""

    preset: str | None = field(default=None, metadata=_flag("--prune-preset", choices=tuple(PRUNE_PRESETS)))
    """study: position alpha=0.6, sequence rho_min=0.5, branch with q_w=0.5; a --prune-* flag given as well
    overrides its value (default: none, every stochastic pruning off)."""
    position_ratio: float | None = field(default=None, metadata=_flag("--prune-position-ratio", shown_default=1.0))
    """alpha: fraction of response positions scored by the LM head (uniform subset; unbiased reward); 1 = off."""
    seq_min_ratio: float | None = field(default=None, metadata=_flag("--prune-seq-min-ratio", shown_default=1.0))
    """rho_min: each response keeps a prefix of ratio rho ~ U(rho_min, 1) (changes the objective); 1 = off."""
    branch: bool | None = field(default=None, metadata=_flag("--prune-branch", bool_off="--no-prune-branch",
                                                             shown_default=False))
    """Branch pruning: only one of chosen/rejected keeps its backward graph, weighted 1/q (unbiased)."""
    branch_chosen_prob: float | None = field(default=None, metadata=_flag("--prune-branch-chosen-prob",
                                                                          shown_default=0.5))
    """q_w: probability of keeping the chosen branch under --prune-branch (q_l = 1 - q_w)."""
    selective_head: bool = field(default=True, metadata=_flag("--selective-head", bool_off="--no-selective-head"))
    """Run the LM head only at scored response positions (exact; off: full-vocabulary logits, then index)."""

    def __post_init__(self) -> None:
        if self.preset is not None and self.preset not in PRUNE_PRESETS:
            raise ValueError(f"--prune-preset must be one of {', '.join(PRUNE_PRESETS)}, got {self.preset!r}")
        base = PRUNE_PRESETS[self.preset] if self.preset else PRUNE_OFF
        for name, value in base.items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if not 0.0 < self.position_ratio <= 1.0:
            raise ValueError(f"--prune-position-ratio must be in (0, 1], got {self.position_ratio}")
        if not 0.0 < self.seq_min_ratio <= 1.0:
            raise ValueError(f"--prune-seq-min-ratio must be in (0, 1], got {self.seq_min_ratio}")
        if not 0.0 < self.branch_chosen_prob < 1.0:
            raise ValueError(f"--prune-branch-chosen-prob must be in (0, 1), got {self.branch_chosen_prob}")

    @classmethod
    def off(cls, *, selective_head: bool = True) -> "PruneConfig":
        """No pruning of the objective (position, sequence, branch); the head is the run's choice:
        it is exact either way, and evaluation or a precomputed reference scored with another head
        than the training pass would differ from it by rounding."""
        return cls(position_ratio=1.0, seq_min_ratio=1.0, branch=False, selective_head=selective_head)


@dataclass(kw_only=True)
class DPOConfig:
    """The DPO objective and its data."""

    data_path: list[str] = field(default_factory=list, metadata=_flag("--data-path", nargs="+"))
    """Preference files (.jsonl, .json as JSON Lines or one array, optionally .gz; .parquet): prompt/chosen/rejected, HH-RLHF or HelpSteer3 records (required to train)."""
    eval_data_path: list[str] = field(default_factory=list, metadata=_flag("--eval-data-path", nargs="+"))
    """Held-out preference files; reward accuracy is measured on them at --eval-interval."""
    eval_interval: int | None = field(default=None, metadata=_flag("--eval-interval"))
    """Evaluate every N steps and at the end when --eval-data-path is set (default: only at the end)."""
    data_format: str = field(default="auto", metadata=_flag("--data-format", choices=("auto", "explicit", "hh", "helpsteer3")))
    """Record format, detected per record by default: explicit (prompt, chosen, rejected: strings or
    chat messages), hh (chosen and rejected without a prompt: HH-RLHF transcripts, or chat messages
    whose shared messages are the prompt) or helpsteer3 (context, response1/2, overall_preference)."""
    skip_invalid: bool = field(default=False, metadata=_flag("--skip-invalid-records"))
    """Skip malformed records with a counted, logged warning instead of stopping at the first one."""
    beta: float = field(default=1.0, metadata=_flag("--dpo-beta"))
    """beta of the DPO logistic loss."""
    loss_average: str = field(default="mean", metadata=_flag("--dpo-logp-reduction", choices=("mean", "sum")))
    """Per-response log-ratio: length-averaged (mean, the study's choice) or summed."""
    layout: str = field(default="concat", metadata=_flag("--dpo-layout", choices=("full", "concat", "shared")))
    """full: chosen and rejected as padded rows; concat: both packed in one row as independent sequences;
    shared: one row [prompt, chosen, rejected] per pair, the prompt run once (exact; needs the selective head)."""
    pack_rows: bool = field(default=False, metadata=_flag("--dpo-pack-rows"))
    """Lay each microbatch's rows end to end in one row, so no pass runs the padding between pairs, and spread
    each pass's pairs to balance the microbatches' tokens (exact; concat and shared layouts). Off by default:
    the padded rows are Megatron's usual [b, s] shapes."""
    ref_mode: str | None = field(default=None, metadata=_flag("--ref-mode", choices=("online", "precomputed", "adapter-off")))
    """online: a frozen reference model runs forward-only; precomputed: reference log-probs cached on disk
    (the reference model is freed once they are, unless --eval-data-path keeps it for the held-out pairs);
    adapter-off: the policy itself with its LoRA adapters switched off (no second model). Default: adapter-off
    with --lora-rank > 0, online otherwise."""
    ref_load: str | None = field(default=None, metadata=_flag("--ref-load"))
    """Checkpoint of the reference model, full weights (default: the starting model, with --finetune the loaded weights; a resumed run uses the one it recorded, whatever --model-preset/--hf-model say). Under LoRA it makes --ref-mode online the default."""
    ref_cache: str | None = field(default=None, metadata=_flag("--ref-cache"))
    """Directory of the precomputed reference log-probs (default: <save or data dir>/ref_logps); one
    file per reference model and tokenized data, reused when both are the same."""

    def __post_init__(self) -> None:
        if not (self.beta > 0 and math.isfinite(self.beta)):
            raise ValueError(f"--dpo-beta must be a finite number > 0, got {self.beta}")
        if self.eval_interval is not None and not self.eval_data_path:
            raise ValueError("--eval-interval needs --eval-data-path (the held-out pairs to evaluate on)")
        if self.ref_cache is not None and self.ref_mode != "precomputed":
            raise ValueError("--ref-cache needs --ref-mode precomputed (only precomputed reference log-probs are cached)")
        if self.ref_cache is not None and os.path.exists(self.ref_cache) and not os.path.isdir(self.ref_cache):
            raise ValueError(f"--ref-cache {self.ref_cache}: exists and is not a directory")
        if self.pack_rows and self.layout == "full":
            raise ValueError("--dpo-pack-rows needs --dpo-layout concat or shared: the full layout's rows "
                             "have no segments to keep the packed pairs apart")
        if self.eval_interval is not None and self.eval_interval < 1:
            raise ValueError(f"--eval-interval must be >= 1, got {self.eval_interval}")
