"""Seeded bugs of the shared core (log-prob op, packing masks, draws, sampler, reference, MoE) and the
tests that must catch each; two canaries check the harness itself.

Format: ``tools/mutants.py`` (``MUTANTS``: name, why, file, old, new, tests).
"""

from __future__ import annotations

OP = "megatron_prune/ops/vocab_parallel_logprobs.py"
OP_UNIT = "tests/unit/ops/test_vocab_parallel_logprobs.py"
OP_TP2 = "tests/distributed/test_logprobs_op.py::test_tp2_matches_single_process_reference"
INVARIANTS = "tests/distributed/test_core_invariants.py"
DRAWS_AGREE = f"{INVARIANTS}::test_pruning_draws_are_the_same_on_every_rank"
REFERENCE_FROZEN = f"{INVARIANTS}::test_reference_stays_the_starting_policy_while_the_policy_trains"
MOE_EP2 = "tests/distributed/test_moe.py::test_expert_parallel_2_ranks_matches_single_rank"
MOE_EP4 = "tests/distributed/test_moe.py::test_expert_parallel_4_ranks_matches_single_rank"

RESUME_REFERENCE = ("tests/e2e/test_user_paths.py::"
                    "test_resume_keeps_the_recorded_reference_and_finetune_compares_with_the_loaded_weights")
MOE = "megatron_prune/model/moe.py"
ROUTER_LOSS_VALUES = ("tests/distributed/test_moe_router_losses.py::"
                      "test_reported_router_losses_equal_megatrons_formulas")
ROUTER_LOSS_DP = ("tests/distributed/test_moe_router_losses.py::"
                  "test_router_losses_are_averaged_over_data_parallel_ranks")
NONFINITE_SKIP = "tests/e2e/test_nonfinite.py::test_nan_on_one_rank_skips_the_step_and_continues"
EXIT_AGREED = "tests/unit/test_exit_conditions.py::test_a_signal_on_one_rank_stops_every_rank_after_the_same_step"
EXIT_RESUMES = ("tests/e2e/test_exit_conditions.py::"
                "test_duration_and_interval_stop_after_a_save_and_the_same_command_resumes_exactly")

MUTANTS: list[dict] = [
    {
        "name": "exit-signal-not-agreed-across-ranks",
        "why": "each rank stops on its own signal: a rank that got none waits in the next step's collectives",
        "file": "megatron_prune/training/exit_conditions.py",
        "old": "received, timed_out = any_rank(self.received, timed_out)",
        "new": "received = self.received",
        "tests": [EXIT_AGREED],
    },
    {
        "name": "resume-keeps-the-checkpoints-adam-betas",
        "why": "loading the optimizer restores the checkpoint's betas and epsilon; a changed flag is named but not used",
        "file": "megatron_prune/training/loop.py",
        "old": "    _apply_optimizer_flags(parts.optimizer)\n",
        "new": "",
        "tests": ["tests/e2e/test_resume.py::test_changed_adam_flags_apply_after_the_optimizer_state_is_loaded"],
    },
    {
        "name": "override-schedule-keeps-the-checkpoints-peak-rate",
        "why": "under --override-opt-param-scheduler the loaded param groups keep the checkpoint's max_lr and min_lr, "
               "which Megatron's scheduler reads first: a new --lr or --min-lr is announced but not used",
        "file": "megatron_prune/training/loop.py",
        "old": "            _apply_schedule_flags(parts.optimizer, parts.scheduler)\n",
        "new": "            pass\n",
        "tests": ["tests/e2e/test_resume.py::"
                  "test_a_run_extended_past_its_decay_is_warned_and_override_decays_over_the_new_horizon"],
    },
    {
        "name": "warm-up-start-rate-from-this-launch",
        "why": "the warm-up's starting rate (not in the scheduler's state) comes from this launch's flags: a resume "
               "inside the warm-up with --lr-warmup-iters 0 ramps from --lr instead of from 0",
        "file": "megatron_prune/training/loop.py",
        "old": "        init_lr=0.0,",
        "new": "        init_lr=0.0 if train.lr_warmup_iters else train.lr,",
        "tests": ["tests/e2e/test_resume.py::test_a_resume_inside_the_warm_up_keeps_its_ramp_whatever_this_launch_says"],
    },
    {
        "name": "parallel-groups-keep-megatrons-timeout",
        "why": "--distributed-timeout-minutes reaches the world group only: a dead peer in the gradient all-reduce "
               "keeps the other ranks waiting Megatron's 30 minutes",
        "file": "megatron_prune/training/parallel.py",
        "old": "        **({} if _timeout_minutes is None else {\"distributed_timeout_minutes\": _timeout_minutes}),\n",
        "new": "",
        "tests": ["tests/unit/test_parallel_init.py::test_every_parallel_group_waits_as_long_as_the_timeout_flag_says"],
    },
    {
        "name": "early-exit-without-a-save",
        "why": "the run stops on --exit-interval/--exit-duration-in-mins without saving the step it stops after",
        "file": "megatron_prune/training/loop.py",
        "old": "if ckpt.save and not saved:",
        "new": "if False:",
        "tests": [EXIT_RESUMES],
    },
    {
        "name": "rmsnorm-backward-misses-the-rms-term",
        "why": "the hand-written RMSNorm backward treats 1/rms as a constant (drops its dependence on x)",
        "file": "megatron_prune/model/norm.py",
        "old": "grad_x = (inv_rms * (g - normed * (g * normed).mean(-1, keepdim=True))).to(x.dtype)",
        "new": "grad_x = (inv_rms * g).to(x.dtype)",
        "tests": ["tests/unit/model/test_norm.py::test_gradients_match_autograd_in_float64"],
    },
    {
        "name": "swiglu-backward-wrong-silu-derivative",
        "why": "the hand-written SwiGLU backward uses sigmoid(a) for d silu(a)/da",
        "file": "megatron_prune/model/swiglu.py",
        "old": "torch.ops.aten.silu_backward.grad_input(g * up, gate, grad_input=out[..., :width])",
        "new": "torch.mul(g * up, torch.sigmoid(gate), out=out[..., :width])",
        "tests": ["tests/unit/model/test_swiglu.py::test_gradients_match_autograd_in_float64"],
    },
    {
        "name": "swiglu-not-wired-into-the-model",
        "why": "the dense local spec's MLP falls back to Megatron's glu (same values, more saved memory)",
        "file": "megatron_prune/model/provider.py",
        "old": 'kwargs["use_te_activation_func"] = not use_transformer_engine(parallel) and not arch.is_moe',
        "new": 'kwargs["use_te_activation_func"] = False',
        "tests": ["tests/distributed/test_local_spec.py"],
    },
    {
        "name": "logprobs-padded-vocab-in-normaliser",
        "why": "the forward visits every local weight row, so padded vocabulary rows enter the log-sum-exp",
        "file": OP,
        "old": "    for start, stop in _blocks(shard.valid_rows, chunk_size):\n"
               "        logits = _logits(x, weight[start:stop], temperature)",
        "new": "    for start, stop in _blocks(weight.shape[0], chunk_size):\n"
               "        logits = _logits(x, weight[start:stop], temperature)",
        "tests": [f"{OP_UNIT}::test_padded_vocab_matches_unpadded_reference"],
    },
    {
        "name": "logprobs-tp-shard-offset",
        "why": "TP rank r's first global row is computed from the unpadded vocabulary (r * V // tp), "
               "so rank 1 reads the wrong labels whenever the vocabulary is padded",
        "file": OP,
        "old": "    start = tp_rank * local_rows\n",
        "new": "    start = tp_rank * (vocab_size // tp_size)\n",
        "tests": [OP_TP2],
    },
    {
        "name": "logprobs-chunk-local-lse",
        "why": "the online log-sum-exp does not rescale earlier vocabulary chunks when the running max grows",
        "file": OP,
        "old": "        sumexp.mul_(torch.exp(running_max - new_max))\n",
        "new": "",
        "tests": [f"{OP_UNIT}::test_fp32_matches_reference"],
    },
    {
        "name": "logprobs-shard-local-max",
        "why": "no MAX all-reduce over TP: each rank rescales its sum-exp by its own max before the SUM",
        "file": OP,
        "old": "    _all_reduce(global_max, group, dist.ReduceOp.MAX)\n",
        "new": "",
        "tests": [OP_TP2],
    },
    {
        "name": "logprobs-no-tp-sum",
        "why": "the sum-exp and target logit are not all-reduced over TP: each rank normalises over its shard only",
        "file": OP,
        "old": "    _all_reduce(sums, group, dist.ReduceOp.SUM)\n",
        "new": "",
        "tests": [OP_TP2],
    },
    {
        "name": "logprobs-no-tp-grad-hidden-sum",
        "why": "the backward does not all-reduce grad_hidden over TP: each rank returns its shard's part only",
        "file": OP,
        "old": "            _all_reduce(grad_x, ctx.shard.group, dist.ReduceOp.SUM)\n",
        "new": "",
        "tests": [OP_TP2],
    },
    {
        "name": "packing-causal-mask",
        "why": "a packed row gets one causal mask over the whole row instead of a block-diagonal one: "
               "each sequence attends to the sequences packed before it",
        "file": "megatron_prune/data/packing.py",
        "old": "    return ~(same_segment & causal)\n",
        "new": "    return ~causal\n",
        "tests": ["tests/unit/test_packing.py::test_row_tensors",
                  "tests/unit/test_packing.py::test_packed_attention_equals_separate_runs"],
    },
    {
        "name": "dpo-concat-causal-mask",
        "why": "a concat row (chosen and rejected packed together) is masked causally over the whole row, "
               "so the rejected sequence attends to the chosen one",
        "file": "megatron_prune/dpo/batch.py",
        "old": "segment_rows[row].append(Segment(start, end))\n",
        "new": "segment_rows[row].append(Segment(start, end, 0, start))\n",
        "tests": ["tests/unit/test_core_invariants.py::test_concat_rows_mask_each_sequence_from_the_others"],
    },
    {
        "name": "rho-draw-depends-on-rank",
        "why": "the sequence-pruning ratio rho is drawn with the rank in its key: TP/PP peers truncate "
               "differently and DP ranks optimise another objective than the single-rank run",
        "file": "megatron_prune/sampling.py",
        "old": "    rho = min_ratio + (1.0 - min_ratio) * uniform(seed, step, sample_id, what)\n",
        "new": "    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0\n"
               "    rho = min_ratio + (1.0 - min_ratio) * uniform(seed + rank, step, sample_id, what)\n",
        "tests": [DRAWS_AGREE],
    },
    {
        "name": "sampler-position-not-restored",
        "why": "a resumed sampler restores the epoch but restarts it from position 0 (samples seen twice)",
        "file": "megatron_prune/data/sampler.py",
        "old": "        self.epoch, self.position, self._order, self.deferred = epoch, position, None, list(deferred)\n",
        "new": "        self.epoch, self.position, self._order, self.deferred = epoch, 0, None, list(deferred)\n",
        "tests": ["tests/unit/data/test_sampler.py::test_sampler_resumes_exactly"],
    },
    {
        "name": "sampler-deferred-not-restored",
        "why": "a resumed GRPO sampler forgets the prompts it deferred at an epoch boundary (never drawn that epoch)",
        "file": "megatron_prune/data/sampler.py",
        "old": "        self.epoch, self.position, self._order, self.deferred = epoch, position, None, list(deferred)\n",
        "new": "        self.epoch, self.position, self._order, self.deferred = epoch, position, None, []\n",
        "tests": ["tests/unit/data/test_sampler.py::test_distinct_sampler_resumes_exactly_with_deferred_indices"],
    },
    {
        "name": "sampler-repeat-not-deferred",
        "why": "a GRPO step that crosses an epoch draws a prompt twice (its groups collide)",
        "file": "megatron_prune/data/sampler.py",
        "old": "            if index in taken:  # only after crossing into a new epoch: its turn comes next request\n",
        "new": "            if False:\n",
        "tests": ["tests/unit/data/test_sampler.py"],
    },
    {
        "name": "reference-shares-policy",
        "why": "the DPO trainer's reference is the policy itself (shared parameters): every log-ratio stays 0",
        "file": "megatron_prune/dpo/trainer.py",
        "old": "        return session.build_reference(arch, parallel, model_cfg, train_cfg, ref_source, lora_base=lora_base,\n"
               "                                       ckpt=ckpt_cfg)\n",
        "new": "        return parts.model\n",
        "tests": [REFERENCE_FROZEN],
    },
    {
        "name": "reference-start-flags-override-the-recorded-one",
        "why": "a resumed run that still names --model-preset/--hf-model compares against the fresh "
               "starting weights instead of the reference its checkpoint records",
        "file": "megatron_prune/training/session.py",
        "old": "    if not ckpt.load:\n        return None\n    meta = read_meta(ckpt.load)\n",
        "new": "    if not ckpt.load or model.model_preset or model.hf_model:\n        return None\n"
               "    meta = read_meta(ckpt.load)\n"
               "    from megatron_prune.training.checkpoint import read_meta\n",
        "tests": [RESUME_REFERENCE],
    },
    {
        "name": "reference-recorded-as-its-save-folder",
        "why": "a reference named by a save folder (--finetune, --ref-load) is recorded as the folder, so a resumed "
               "run compares against whatever that run saved there since",
        "file": "megatron_prune/training/session.py",
        "old": "    if ckpt.finetune and not meta.get(\"lora\"):\n        return os.path.abspath(find_latest(ckpt.load))\n",
        "new": "    if ckpt.finetune and not meta.get(\"lora\"):\n        return ckpt.load\n",
        "tests": ["tests/unit/test_lora_base.py::test_a_reference_named_by_its_save_folder_is_recorded_as_one_checkpoint"],
    },
    {
        "name": "finetune-keeps-the-recorded-reference",
        "why": "--finetune compares against the loaded checkpoint's own recorded reference, not the "
               "loaded weights it starts from (step 0 has a non-zero margin)",
        "file": "megatron_prune/training/session.py",
        "old": "    if ckpt.finetune and not meta.get(\"lora\"):\n        return os.path.abspath(find_latest(ckpt.load))\n",
        "new": "",
        "tests": [RESUME_REFERENCE],
    },
    {
        "name": "resume-forgets-the-hf-reference",
        "why": "a run started from --hf-model and resumed with --load alone compares against the "
               "preset-style random initialisation instead of the HF weights it started from",
        "file": "megatron_prune/training/session.py",
        "old": "            return meta[\"reference_hf_model\"]\n",
        "new": "            pass\n",
        "tests": ["tests/e2e/test_hf_model_cli.py::test_dpo_from_hf_model_then_export"],
    },
    {
        "name": "canary-spawned-ranks-import-copy",
        "why": "harness self-check: ranks spawned by tests/dist.py must import the copy's "
               "megatron_prune.patches (the editable install maps it to the real patches/); if this "
               "survives, no mutant of patches/ is ever tested",
        "file": "patches/__init__.py",
        "old": '    return apply_patches("cpu")\n',
        "new": '    raise RuntimeError("mutation canary: the copy\'s patches were imported")\n',
        "tests": [DRAWS_AGREE],
    },
    {
        "name": "canary-torchrun-imports-copy",
        "why": "harness self-check: a CLI launched through torchrun must run the copy's megatron_prune "
               "(here: --dry-run no longer lists the configs); if this survives, e2e tests see no mutant",
        "file": "megatron_prune/training/cli.py",
        "old": '                print(f"  {name}: {cfg}")\n',
        "new": "                pass\n",
        "tests": ["tests/e2e/test_grpo_cli.py::test_dry_run_and_bad_flags"],
    },
    {
        "name": "decode-attention-heads-take-groups-round-robin",
        "why": "the one-query decoding path gives query head h the key/value group h % ng instead of "
               "h // (np / ng): with grouped-query attention every cached token is decoded against the "
               "wrong heads' keys",
        "file": "megatron_prune/model/decode_attention.py",
        "old": "q = query.reshape(b, ng, np_ // ng, hn).to(compute)",
        "new": "q = query.reshape(b, np_ // ng, ng, hn).transpose(1, 2).to(compute)",
        "tests": ["tests/unit/model/test_decode_attention.py::test_equals_plain_attention_over_repeated_groups"],
    },
    {
        "name": "rotated-key-cache-stores-unrotated-keys",
        "why": "the static KV cache stores keys without their rotary embedding while the forward is told they "
               "are rotated: every cached key attends as if it sat at position 0",
        "file": "megatron_prune/model/decode_attention.py",
        "old": "key = apply_rotary_pos_emb(key, rotary_pos_emb[1][start : start + key.size(0)],",
        "new": "key = apply_rotary_pos_emb(key, 0 * rotary_pos_emb[1][start : start + key.size(0)],",
        "tests": ["tests/unit/model/test_decode_attention.py::test_rotated_key_cache_gives_megatrons_bits"],
    },
    {
        "name": "kv-cache-sequence-major",
        "why": "the KV cache for the per-group decoding path is stored sequence-major, so every decoding "
               "step reads each row's keys scattered over the whole cache",
        "file": "megatron_prune/model/decode_attention.py",
        "old": "        return torch.empty((batch_size, shape[2], shape[0], dim), dtype=dtype, device=device).permute(2, 0, 1, 3)\n",
        "new": "        return torch.empty(shape, dtype=dtype, device=device)\n",
        "tests": ["tests/unit/model/test_decode_attention.py::test_rotated_key_cache_gives_megatrons_bits"],
    },
    {
        "name": "decode-attention-in-training",
        "why": "the decoding path also runs in training mode, where Megatron's attention applies dropout",
        "file": "megatron_prune/model/segment_attention.py",
        "old": "return (not self.training and len(args) <= 1",
        "new": "return (len(args) <= 1",
        "tests": ["tests/unit/model/test_decode_attention.py::test_local_core_attention_decodes_per_group_and_matches_megatron"],
    },
    {
        "name": "segment-causal-not-offset-by-prefix",
        "why": "segment attention's causal mask counts key positions from the start of [prefix ; own] "
               "instead of after the prefix: a response sees the wrong own keys (or too few) whenever "
               "it has a shared prompt",
        "file": "megatron_prune/model/segment_attention.py",
        "old": "            own = j[:, None, :] - prefix[:, :, None]\n",
        "new": "            own = j[:, None, :] + 0 * prefix[:, :, None]\n",
        "tests": ["tests/unit/model/test_segment_attention.py::test_random_layouts_equal_dense_reference"],
    },
    {
        "name": "segment-join-across-padding",
        "why": "a prompt and a response that does not start where the prompt ends are joined into one "
               "causal segment: the padding between them becomes queries and keys of the response",
        "file": "megatron_prune/model/segment_attention.py",
        "old": "        if not seg.length or not seg.prefix_length or seg.prefix_end != seg.start:\n",
        "new": "        if not seg.length or not seg.prefix_length:\n",
        "tests": ["tests/unit/model/test_segment_attention.py::test_a_response_after_padding_does_not_join_its_prompt"],
    },
    {
        "name": "segment-joined-group-masked-as-prefixed",
        "why": "prefix-less segments are grouped with prefixed ones and run without a mask: a response "
               "group loses its prefix-and-causal mask",
        "file": "megatron_prune/model/segment_attention.py",
        "old": " or (item[4] > 0) != (members[0][4] > 0)):\n",
        "new": "):\n",
        "tests": ["tests/unit/model/test_segment_attention.py::test_random_layouts_equal_dense_reference"],
    },
    {
        "name": "segment-rotary-from-row-index",
        "why": "with segments the model keeps Megatron's row-index rotary positions: a rejected response "
               "placed after the chosen one rotates as if it followed chosen, not the prompt",
        "file": "megatron_prune/model/selective_gpt.py",
        "old": "        return (out[0], self._per_token_rotary(positions), *out[2:])\n",
        "new": "        return out\n",
        "tests": ["tests/distributed/test_segment_attention.py::test_shared_row_equals_separate_rows"],
    },
    {
        "name": "baseline-head-ignores-temperature",
        "why": "the full-vocabulary head (all_labels) scores at temperature 1 whatever the selection asks, "
               "while the selective head divides by it: the two heads disagree",
        "file": "megatron_prune/model/selective_gpt.py",
        "old": "            logits = logits.float() / self._position_temperature(selection, logits.shape[:2])\n",
        "new": "            logits = logits.float()\n",
        "tests": ["tests/distributed/test_selective_head_temperature.py"],
    },
    {
        "name": "grpo-shared-positions-follow-row",
        "why": "GRPO --shared-prompt numbers positions along the row, so completion j rotates as if it "
               "followed completions 1..j-1 instead of the prompt",
        "file": "megatron_prune/grpo/step.py",
        "old": "        return torch.cat([torch.arange(p)] + [torch.arange(p, p + len(it.completion)) for it in self.items])\n",
        "new": "        return torch.arange(self.length)\n",
        "tests": ["tests/distributed/test_grpo_shared_prompt.py::test_shared_prompt_equals_unshared"],
    },
    {
        "name": "moe-router-loss-summed-over-dp",
        "why": "the reported router losses are summed over data-parallel ranks instead of averaged: "
               "moe_aux_loss and moe_z_loss grow with the number of ranks",
        "file": "megatron_prune/model/moe.py",
        "old": "            total /= parallel_state.get_data_parallel_world_size()\n",
        "new": "",
        "tests": [ROUTER_LOSS_DP],
    },
    {
        "name": "moe-layer-pattern-ignores-stage",
        "why": "each pipeline stage reads the dense/MoE layer pattern from layer 0 instead of its own "
               "first layer: later stages build the wrong MLP for some layers",
        "file": "megatron_prune/model/moe.py",
        "old": "pattern[offset + i]",
        "new": "pattern[i]",
        "tests": [MOE_EP4],
    },
    {
        "name": "moe-fused-gate-up-swapped",
        "why": "the fused HF expert layout (experts.gate_up_proj) is split with gate and up exchanged",
        "file": "megatron_prune/model/hf_mapping.py",
        "old": "                            self._virtual[f\"{base}{e}.gate_proj.weight\"] = (name, e, 0)\n"
               "                            self._virtual[f\"{base}{e}.up_proj.weight\"] = (name, e, 1)\n",
        "new": "                            self._virtual[f\"{base}{e}.gate_proj.weight\"] = (name, e, 1)\n"
               "                            self._virtual[f\"{base}{e}.up_proj.weight\"] = (name, e, 0)\n",
        "tests": ["tests/distributed/test_moe_conversion.py::"
                  "test_fused_and_per_expert_layouts_map_to_the_same_megatron_state"],
    },
    {
        "name": "skipped-step-advances-the-schedule",
        "why": "--on-nonfinite skip leaves the weights alone but steps the learning-rate schedule",
        "file": "megatron_prune/training/loop.py",
        "old": "                skipped_in_a_row += 1\n",
        "new": "                skipped_in_a_row += 1\n                parts.scheduler.step(1)\n",
        "tests": [NONFINITE_SKIP],
    },
    {
        "name": "skipped-step-runs-adam-on-zeroed-grads",
        "why": "a skipped step zeroes the gradients and steps Adam anyway: its moments still move the weights",
        "file": "megatron_prune/training/loop.py",
        "old": "                if finite:\n                    success, grad_norm, _ = parts.optimizer.step()\n",
        "new": "                if not finite:\n                    for chunk in parts.model:\n                        chunk.zero_grad_buffer()\n"
               "                    parts.optimizer.zero_grad()\n                    parts.optimizer.step()\n"
               "                if finite:\n                    success, grad_norm, _ = parts.optimizer.step()\n",
        "tests": [NONFINITE_SKIP],
    },
    {
        "name": "router-loss-coefficient-applied-twice",
        "why": "the reported router losses are scaled by the coefficient twice (Megatron's tracker stores loss / coeff)",
        "file": MOE,
        "old": "out[metric] = coeffs[metric] * float(total)\n",
        "new": "out[metric] = coeffs[metric] ** 2 * float(total)\n",
        "tests": [ROUTER_LOSS_VALUES],
    },
    {
        "name": "router-loss-summed-over-microbatches",
        "why": "the tracker accumulates over microbatches and the sum is reported, not the mean",
        "file": MOE,
        "old": "        total /= max(num_microbatches, 1)  # ranks may run different numbers of microbatches\n",
        "new": "",
        "tests": [ROUTER_LOSS_VALUES],
    },
    {
        "name": "router-loss-tracker-entries-swapped",
        "why": "moe_aux_loss reports Megatron's z-loss entry and moe_z_loss the load-balancing one",
        "file": MOE,
        "old": 'ROUTER_LOSS_NAMES = {"load_balancing_loss": "moe_aux_loss", "z_loss": "moe_z_loss"}',
        "new": 'ROUTER_LOSS_NAMES = {"load_balancing_loss": "moe_z_loss", "z_loss": "moe_aux_loss"}',
        "tests": [ROUTER_LOSS_VALUES],
    },
    {
        "name": "router-loss-last-layer-only",
        "why": "only the last layer's tracker slot is read: the other MoE layers' router losses are dropped",
        "file": MOE,
        "old": 'total += entry["values"].detach().double().sum().cpu()',
        "new": 'total += entry["values"].detach().double()[-1:].sum().cpu()',
        "tests": [ROUTER_LOSS_VALUES],
    },
    {
        "name": "dpo-router-losses-count-padding",
        "why": "the DPO forward step drops the padding mask: a MoE router's load-balancing and z-losses (and their "
               "gradient) count the pad tokens, so they depend on how rows are padded",
        "file": "megatron_prune/dpo/step.py",
        "old": "    if batch.padding_mask is not None:\n        extra[\"padding_mask\"] = batch.padding_mask\n",
        "new": "",
        "tests": [ROUTER_LOSS_VALUES],
    },
    {
        "name": "dpo-padding-mask-off-by-one",
        "why": "a DPO row's padding mask starts one position late: its first pad token is counted as a real one",
        "file": "megatron_prune/dpo/batch.py",
        "old": "    return torch.arange(seq_length)[None, :] >= torch.tensor(used, dtype=torch.long)[:, None]\n",
        "new": "    return torch.arange(seq_length)[None, :] > torch.tensor(used, dtype=torch.long)[:, None]\n",
        "tests": [ROUTER_LOSS_VALUES],
    },
    {
        "name": "dpo-joined-pruned-branch-in-router-losses",
        "why": "a branch-pruned response run inside the shared layout's training row counts in the router losses: "
               "where a cost heuristic runs it changes the router losses and the gradient",
        "file": "megatron_prune/dpo/batch.py",
        "old": "    for row, start, end in untrained:\n        padding_mask[row, start:end] = True\n",
        "new": "",
        "tests": ["tests/distributed/test_moe_router_losses.py::"
                  "test_a_pruned_branch_in_the_training_row_adds_no_router_loss"],
    },
    {
        "name": "te-spec-keeps-megatrons-router",
        "why": "the Transformer-Engine layer spec (the default on a GPU with TE) keeps Megatron's own router, whose "
               "z-loss with padding is a mean of the sequence-parallel shards' means",
        "file": "megatron_prune/model/provider.py",
        "old": "        with_group_mean_z_loss(with_rotated_key_cache(with_segment_attention(layer)))",
        "new": "        with_rotated_key_cache(with_segment_attention(layer))",
        "tests": ["tests/distributed/test_local_spec.py::test_transformer_engine_path_builds_with_our_router"],
    },
    {
        "name": "no-te-patches-on-cpu-only",
        "why": "the MoE router's no-Transformer-Engine patches are applied on CPU only: a GPU without TE raises "
               "NameError (te_general_gemm) at the first MoE forward",
        "file": "megatron_prune/training/parallel.py",
        "old": "    apply_missing_te_patches()\n",
        "new": "    if acc.kind == \"cpu\":\n        apply_missing_te_patches()\n",
        "tests": ["tests/unit/test_patches.py::test_initialize_distributed_applies_the_no_te_patches_off_the_cpu_too"],
    },
    {
        "name": "across-split-step-per-parameter-only",
        "why": "a resume across the expert split gives every optimizer the step as torch's per-parameter "
               "common_step: Transformer Engine's and Apex's fused Adam, which read it from the param groups, "
               "restart bias correction at step 1 (Apex) or fail to load (TE)",
        "file": "megatron_prune/training/checkpoint.py",
        "old": "        if _is_torch_adam(part.optimizer):\n",
        "new": "        if True:\n",
        "tests": ["tests/distributed/test_moe.py::test_fused_adam_resumes_across_the_split_at_its_step"],
    },
    {
        "name": "z-loss-mean-of-shard-means",
        "why": "Megatron's own router: with sequence parallelism the z-loss averages each TP shard's mean over its "
               "real tokens, so a padded microbatch's z-loss depends on the TP size and on where the padding falls",
        "file": MOE,
        "old": "    moe_spec = with_group_mean_z_loss(moe_spec)\n",
        "new": "",
        "tests": ["tests/distributed/test_moe.py::test_expert_parallel_4_ranks_matches_single_rank"],
    },
    {
        "name": "reduce-metrics-mean-of-microbatch-means",
        "why": "[sum, count] metrics (GRPO's per-token clip fraction, ratio, KL) are averaged per microbatch, not "
               "pooled over their tokens",
        "file": "megatron_prune/training/step.py",
        "old": "            totals[i] += v if v.numel() == 2 else torch.stack([v[0], torch.ones((), dtype=torch.float64)])",
        "new": "            totals[i] += (torch.stack([v[0] / v[1], torch.ones((), dtype=torch.float64)]) if v.numel() == 2\n"
               "                          else torch.stack([v[0], torch.ones((), dtype=torch.float64)]))",
        "tests": [f"{INVARIANTS}::test_reduce_metrics_pools_sum_and_count"],
    },
    {
        "name": "eval-interval-off-by-one",
        "why": "held-out evaluation runs after steps 1, N+1, ... instead of N, 2N, ...",
        "file": "megatron_prune/training/loop.py",
        "old": "if eval_interval and ((step + 1) % eval_interval == 0 or",
        "new": "if eval_interval and (step % eval_interval == 0 or",
        "tests": ["tests/e2e/test_user_paths.py::test_eval_runs_after_every_eval_interval_steps"],
    },
    {
        "name": "interleaved-schedule-rounds-to-the-model-chunks",
        "why": "the interleaved schedule takes microbatches in groups of one per pipeline stage; rounding to the "
               "model chunks instead is refused by Megatron whenever PP != VPP",
        "file": "megatron_prune/training/parallel.py",
        "old": "        stages = parallel_state.get_pipeline_model_parallel_world_size()\n",
        "new": "        stages = parallel_state.get_virtual_pipeline_model_parallel_world_size()\n",
        "tests": ["tests/unit/test_schedule_and_lengths.py::test_interleaved_schedule_runs_a_multiple_of_the_pipeline_stages"],
    },
    {
        "name": "flash-attn-2-0-accepted",
        "why": "flash-attn 2.0 aligns the causal mask top-left when a segment has fewer queries than keys: every "
               "segment with a prefix would attend to the wrong keys on the GPU",
        "file": "megatron_prune/model/segment_attention.py",
        "old": "if version < Version(\"2.1\") or",
        "new": "if version < Version(\"2.0\") or",
        "tests": ["tests/unit/model/test_segment_attention.py::test_flash_only_where_its_causal_rule_and_the_gpu_fit"],
    },
    {
        "name": "segment-plan-keyed-on-the-tensor-object",
        "why": "under recomputation every layer gets a detached copy of the table: a plan keyed on the object is "
               "rebuilt (host loops and copies) once per layer in the backward",
        "file": "megatron_prune/model/segment_attention.py",
        "old": "    key = (table.data_ptr(), tuple(table.shape),",
        "new": "    key = (id(table), tuple(table.shape),",
        "tests": ["tests/unit/model/test_segment_attention.py::test_recomputed_layers_reuse_the_plan"],
    },
]
