"""Seeded bugs of the DPO objective as the trainer computes it, each with the tests that must catch it.

Format: ``tools/mutants.py`` (``MUTANTS``: name, why, file, old, new, tests).
"""

from __future__ import annotations

OBJECTIVE = "tests/distributed/test_dpo_objective.py"
REFERENCE = f"{OBJECTIVE}::test_pruning_off_equals_independent_reference"
BRANCH = f"{OBJECTIVE}::test_branch_pruning_is_unbiased_through_the_step[concat]"
BRANCH_SHARED = f"{OBJECTIVE}::test_branch_pruning_is_unbiased_through_the_step[shared]"
BRANCH_SHARED_KV = f"{OBJECTIVE}::test_branch_pruning_is_unbiased_through_the_step[shared-prefix-kv]"
BRANCH_SHARED_KV_PACKED = f"{OBJECTIVE}::test_branch_pruning_is_unbiased_through_the_step[shared-prefix-kv-packed]"
POSITION = f"{OBJECTIVE}::test_position_pruning_reward_estimate_is_unbiased_through_the_step"
STRUCTURE = f"{OBJECTIVE}::test_branch_pruning_saves_compute_by_structure"
BRANCH_RATE = f"{OBJECTIVE}::test_branch_draw_keeps_chosen_at_rate_q"
PIPELINE_KV = "tests/distributed/test_dpo_shared.py::test_pruned_responses_on_stored_keys_cross_pipeline_stages"
LOSS_UNIT = "tests/unit/test_dpo_loss.py"
SHARED_UNIT_FILE = "tests/unit/test_dpo_microbatches.py"
SHARED_UNIT = f"{SHARED_UNIT_FILE}::test_shared_row_layout_positions_and_scored_tokens"

MUTANTS: list[dict] = [
    {
        "name": "dpo-step-may-hold-a-pair-twice",
        "why": "a step that crosses into the next epoch takes pairs of the new epoch's head that it already holds: "
               "those pairs count twice in that step's loss",
        "file": "megatron_prune/dpo/trainer.py",
        "old": "distinct=len(dataset) >= train_cfg.global_batch_size)",
        "new": "distinct=False)",
        "tests": ["tests/unit/test_dpo_sampling.py"],
    },
    {
        "name": "dpo-margin-sign",
        "why": "the margin is taken as rejected minus chosen: DPO trains the policy towards the rejected answers",
        "file": "megatron_prune/dpo/loss.py",
        "old": "margin = beta * (chosen - rejected)",
        "new": "margin = beta * (rejected - chosen)",
        "tests": [LOSS_UNIT, REFERENCE],
    },
    {
        "name": "dpo-beta-dropped",
        "why": "the margin ignores beta (the --dpo-beta flag has no effect)",
        "file": "megatron_prune/dpo/loss.py",
        "old": "margin = beta * (chosen - rejected)",
        "new": "margin = chosen - rejected",
        "tests": [LOSS_UNIT, REFERENCE],
    },
    {
        "name": "dpo-position-off-drops-last-token",
        "why": "with position pruning off, the last response token is never scored",
        "file": "megatron_prune/sampling.py",
        "old": "    if ratio >= 1.0:\n        return torch.arange(length)",
        "new": "    if ratio >= 1.0:\n        return torch.arange(max(1, length - 1))",
        "tests": [REFERENCE],
    },
    {
        "name": "dpo-sequence-off-drops-last-token",
        "why": "with sequence pruning off, every response loses its last token",
        "file": "megatron_prune/sampling.py",
        "old": "    if min_ratio >= 1.0 or length <= 1:\n        return length",
        "new": "    if min_ratio >= 1.0 or length <= 1:\n        return max(1, length - 1)",
        "tests": [REFERENCE],
    },
    {
        "name": "dpo-scored-position-shift",
        "why": "scored positions are off by one: each response token is read at its own position, not the one predicting it",
        "file": "megatron_prune/dpo/batch.py",
        "old": "positions = start + len(plan.prompt) + scored - 1",
        "new": "positions = start + len(plan.prompt) + scored",
        "tests": [REFERENCE],
    },
    {
        "name": "dpo-loss-summed-over-pairs",
        "why": "the microbatch loss sums the pair losses: the gradient grows with the micro-batch size",
        "file": "megatron_prune/dpo/step.py",
        "old": "        loss = losses.mean()\n",
        "new": "        loss = losses.sum()\n",
        "tests": [REFERENCE],
    },
    {
        "name": "dpo-reference-from-policy",
        "why": "the reference log-probs come from the policy, so every log-ratio is 0",
        "file": "megatron_prune/dpo/step.py",
        "old": "outputs = self._forward_only(self.reference, batches, seq_length)",
        "new": "outputs = self._forward_only(self.policy, batches, seq_length)",
        "tests": [REFERENCE],
    },
    {
        "name": "dpo-mean-divides-by-length",
        "why": "the mean log-ratio divides by the response length instead of the scored positions (biased under position pruning)",
        "file": "megatron_prune/dpo/loss.py",
        "old": "        coef = 1.0 / num_scored_t\n",
        "new": "        coef = 1.0 / torch.tensor(lengths, dtype=torch.float32)\n",
        "tests": [POSITION],
    },
    {
        "name": "dpo-sum-not-rescaled",
        "why": "the summed log-ratio is not rescaled by T/|S| under position pruning (biased towards 0)",
        "file": "megatron_prune/dpo/loss.py",
        "old": "        coef = torch.tensor(lengths, dtype=torch.float32, device=device) / num_scored_t\n",
        "new": "        coef = torch.ones_like(num_scored_t)\n",
        "tests": [POSITION],
    },
    {
        "name": "dpo-training-pass-divisor",
        "why": "the training pass divides by the response length, not its scored positions",
        "file": "megatron_prune/dpo/step.py",
        "old": "num_scored=[r.num_scored for r in batch.responses], lengths=[r.length for r in batch.responses],",
        "new": "num_scored=[r.length for r in batch.responses], lengths=[r.length for r in batch.responses],",
        "tests": [POSITION],
    },
    {
        "name": "dpo-pruned-branch-divisor",
        "why": "the pruned branch's log-ratio divides by the response length, not its scored positions",
        "file": "megatron_prune/dpo/step.py",
        "old": "num_scored=[len(val)], lengths=[self._length(plans, key)],",
        "new": "num_scored=[self._length(plans, key)], lengths=[self._length(plans, key)],",
        "tests": [POSITION],
    },
    {
        "name": "dpo-branch-draw-inverted",
        "why": "the branch draw keeps chosen with probability 1 - q_w while the step weights it by 1/q_w",
        "file": "megatron_prune/sampling.py",
        "old": 'return uniform(seed, step, sample_id, "branch") < chosen_prob',
        "new": 'return uniform(seed, step, sample_id, "branch") >= chosen_prob',
        "tests": [BRANCH_RATE, BRANCH],
    },
    {
        "name": "dpo-kept-branch-scale",
        "why": "the kept branch is weighted 1/(1 - q_w) whichever branch it is (right only at q_w = 0.5)",
        "file": "megatron_prune/dpo/step.py",
        "old": "scales.append(1.0 / (q_w if plan.kept_branch == CHOSEN else 1.0 - q_w))",
        "new": "scales.append(1.0 / (1.0 - q_w))",
        "tests": [BRANCH],
    },
    {
        "name": "dpo-kept-branch-unscaled",
        "why": "the kept branch's gradient is not divided by its keep probability (half the expected gradient)",
        "file": "megatron_prune/dpo/step.py",
        "old": "            grad_scale = torch.tensor(scales, device=ratios.device)\n",
        "new": "            grad_scale = None\n",
        "tests": [BRANCH],
    },
    {
        "name": "dpo-pruned-branch-with-grad",
        "why": "the forward-only passes run with autograd on: the pruned branch keeps its activations (no memory saved)",
        "file": "megatron_prune/dpo/step.py",
        "old": "        with torch.no_grad():\n            outputs = run_schedule(",
        "new": "        with contextlib.nullcontext():\n            outputs = run_schedule(",
        "tests": [STRUCTURE],
    },
    {
        "name": "dpo-pruned-branch-in-training-pass",
        "why": "the training pass runs both branches again under branch pruning (same loss, the compute saving is lost)",
        "file": "megatron_prune/dpo/step.py",
        "old": "if p.sample_id in joined else [p.kept_branch]",
        "new": "if p.sample_id in joined else [p.kept_branch, 1 - p.kept_branch]",
        "tests": [STRUCTURE],
    },
    {
        "name": "dpo-pruned-pass-not-regrouped",
        "why": "the pruned branch's forward-only pass keeps micro_batch_size pairs per microbatch: "
               "twice the forward calls for the same tokens",
        "file": "megatron_prune/dpo/step.py",
        "old": "            return mbs\n        return 2 * mbs",
        "new": "            return mbs\n        return mbs",
        "tests": [STRUCTURE],
    },
    {
        "name": "dpo-pruned-pass-regrouped-under-pp-with-remainder",
        "why": "under PP the pruned pass doubles its pairs per microbatch even when they do not fill "
               "the last one (the p2p buffers are shaped for the first microbatch's rows)",
        "file": "megatron_prune/dpo/step.py",
        "old": "get_pipeline_model_parallel_world_size() > 1 and num_pairs % (2 * mbs):",
        "new": "get_pipeline_model_parallel_world_size() > 1 and False:",
        "tests": [STRUCTURE],
    },
    # -- the shared layout [prompt, chosen, rejected] ------------------------------------------------
    {
        "name": "dpo-shared-rejected-positions-continue-after-chosen",
        "why": "rejected's position ids continue after chosen (P+C ...) instead of from the prompt's end: "
               "rotary embeddings see rejected at the wrong distance from the prompt",
        "file": "megatron_prune/dpo/batch.py",
        "old": "positions += range(prompt, prompt + len(response))",
        "new": "positions += range(start, start + len(response))",
        "tests": [SHARED_UNIT, f"{REFERENCE}[shared-mean-2]"],
    },
    {
        "name": "dpo-shared-rejected-first-token-from-chosen",
        "why": "rejected's first token is scored from chosen's last position instead of the prompt's last",
        "file": "megatron_prune/dpo/batch.py",
        "old": "positions = torch.where(scored == 0, len(plan.prompt) - 1, start + scored - 1)",
        "new": "positions = start + scored - 1",
        "tests": [SHARED_UNIT, f"{REFERENCE}[shared-mean-2]"],
    },
    {
        "name": "dpo-shared-rejected-sees-chosen",
        "why": "rejected's prefix runs up to its own start, so it attends to chosen as well as the prompt",
        "file": "megatron_prune/dpo/batch.py",
        "old": "segments.append(Segment(start, start + len(response), 0, prompt))",
        "new": "segments.append(Segment(start, start + len(response), 0, start))",
        "tests": [SHARED_UNIT, f"{REFERENCE}[shared-mean-2]"],
    },
    {
        "name": "dpo-shared-joined-pruned-branch-not-detached",
        "why": "a pruned branch run inside the training row keeps its gradient: branch pruning's gradient is "
               "no longer the unbiased 1/q-weighted kept branch",
        "file": "megatron_prune/dpo/step.py",
        "old": "value = value.detach()  # a pruned response run inside the training row",
        "new": "value = value  # a pruned response run inside the training row",
        "tests": [BRANCH_SHARED],
    },
    {
        "name": "dpo-shared-join-choice-inverted",
        "why": "the pruned branch joins the training row exactly when that costs more than running it apart",
        "file": "megatron_prune/dpo/batch.py",
        "old": "return pruned_backward < prompt_again",
        "new": "return pruned_backward > prompt_again",
        "tests": [f"{SHARED_UNIT_FILE}::test_pruned_branch_joins_the_training_row_when_that_is_cheaper"],
    },
    # -- pruned responses on the training pass's stored prompt keys and values ----------------------
    {
        "name": "dpo-shared-prefix-kv-positions-shifted",
        "why": "the pruned response on stored keys rotates as if it started one position later",
        "file": "megatron_prune/dpo/batch.py",
        "old": "position_ids[0, start : start + length] = torch.arange(prompt - 1, prompt - 1 + length)",
        "new": "position_ids[0, start : start + length] = torch.arange(prompt, prompt + length)",
        "tests": [BRANCH_SHARED_KV],
    },
    {
        "name": "dpo-shared-prefix-kv-last-prompt-key-twice",
        "why": "the stored prefix includes the prompt's last key, which the pruned forward also computes itself",
        "file": "megatron_prune/dpo/batch.py",
        "old": "Segment(stored + start, stored + start + length, first_key, first_key + prompt - 1)",
        "new": "Segment(stored + start, stored + start + length, first_key, first_key + prompt)",
        "tests": [BRANCH_SHARED_KV],
    },
    {
        "name": "dpo-shared-prefix-kv-stored-keys-ignored",
        "why": "the pruned forward does not put the stored keys in front of its own: it never sees its prompt",
        "file": "megatron_prune/model/segment_attention.py",
        "old": "key = torch.cat([end_to_end(stored_key), key])",
        "new": "key = torch.cat([torch.zeros_like(end_to_end(stored_key)), key])",
        "tests": [BRANCH_SHARED_KV],
    },
    {
        "name": "dpo-shared-prefix-kv-prefix-of-the-next-row",
        "why": "each pruned response takes its prefix from the next stored row: another pair's prompt",
        "file": "megatron_prune/dpo/batch.py",
        "old": "first_key = row * stored_length",
        "new": "first_key = ((row + 1) % stored_rows) * stored_length",
        "tests": [BRANCH_SHARED_KV],
    },
    {
        "name": "dpo-shared-prefix-kv-pipeline-rows-interleaved",
        "why": "the pruned responses' hidden states, carried to the next pipeline stage as extra rows, are "
               "read back row-major instead of row by row: positions of different pieces interleave",
        "file": "megatron_prune/dpo/step.py",
        "old": "return part.transpose(0, 1).reshape(rows * length, 1, h)[:n]",
        "new": "return part.reshape(rows * length, 1, h)[:n]",
        "tests": [PIPELINE_KV],
    },
    {
        "name": "dpo-shared-prefix-kv-off-under-pipeline",
        "why": "under pipeline parallelism the pruned responses silently fall back to the costlier schemes "
               "(their prompt again, or a backward)",
        "file": "megatron_prune/dpo/step.py",
        "old": "self._segment_layers = bool(votes[0] == 0 and votes[1] > 0)",
        "new": "self._segment_layers = bool(votes[0] == 0 and votes[1] > 0) and "
               "parallel_state.get_pipeline_model_parallel_world_size() == 1",
        "tests": [PIPELINE_KV],
    },
    # -- packed rows (--dpo-pack-rows) --------------------------------------------------------------
    {
        "name": "dpo-packed-prefix-not-moved",
        "why": "packing moves a row's segments but not their prefixes: responses after the first row attend "
               "to the first pair's prompt",
        "file": "megatron_prune/dpo/batch.py",
        "old": "seg.prefix_start + start if seg.prefix_length else 0,",
        "new": "seg.prefix_start if seg.prefix_length else 0,",
        "tests": [f"{REFERENCE}[shared-mean-2-True-True]"],
    },
    {
        "name": "dpo-packed-scored-positions-not-moved",
        "why": "the scored positions keep their place in the padded row, so packed rows score other tokens",
        "file": "megatron_prune/dpo/batch.py",
        "old": "selection = TokenSelection(index=index // rows + torch.tensor(starts, dtype=torch.long)[index % rows],",
        "new": "selection = TokenSelection(index=index // rows + 0 * torch.tensor(starts, dtype=torch.long)[index % rows],",
        "tests": [f"{REFERENCE}[concat-mean-2-True-True]"],
    },
    {
        "name": "dpo-packed-labels-not-moved",
        "why": "the full-logits head reads the labels of the padded layout in a packed row",
        "file": "megatron_prune/dpo/batch.py",
        "old": "labels[0, start : start + n] = batch.labels[r, :n]",
        "new": "labels[0, :n] = batch.labels[r, :n]",
        "tests": [f"{REFERENCE}[concat-mean-2-True-False]"],
    },
    {
        "name": "dpo-packed-replay-prefix-of-the-next-pair",
        "why": "in a packed row each pruned response takes the next pair's stored prompt as its prefix",
        "file": "megatron_prune/dpo/step.py",
        "old": "pad_id=self.s.pad_id, prompt_starts=batch.row_starts)",
        "new": "pad_id=self.s.pad_id, prompt_starts=batch.row_starts and batch.row_starts[1:] + batch.row_starts[:1])",
        "tests": [BRANCH_SHARED_KV_PACKED],
    },
    {
        "name": "dpo-precomputed-ref-first-positions",
        "why": "the precomputed reference table is read at the first k positions, not at the k that position "
               "pruning scores: the log-ratios subtract the wrong tokens' reference log-probs",
        "file": "megatron_prune/dpo/step.py",
        "old": "self.ref_lookup(p.sample_id, b)[p.scored[b]]",
        "new": "self.ref_lookup(p.sample_id, b)[: len(p.scored[b])]",
        "tests": ["tests/e2e/test_dpo_cli.py::test_precomputed_reference_matches_online"],
    },
    {
        "name": "dpo-ref-cache-key-ignores-tokens",
        "why": "the reference cache is keyed by the model alone: data tokenized otherwise (another --seq-length, "
               "--max-prompt-length, tokenizer or record) reuses a table of other tokens",
        "file": "megatron_prune/dpo/trainer.py",
        "old": "    for pair in dataset.pairs:\n",
        "new": "    for pair in dataset.pairs[:0]:\n",
        "tests": ["tests/unit/test_ref_cache_key.py",
                  "tests/e2e/test_dpo_cli.py::test_precomputed_reference_matches_online"],
    },
    {
        "name": "dpo-ref-cache-key-ignores-prompts",
        "why": "the reference cache key hashes the responses only: prompts cut otherwise reuse the old table",
        "file": "megatron_prune/dpo/trainer.py",
        "old": "for ids in (pair.prompt_ids, pair.chosen_ids, pair.rejected_ids):",
        "new": "for ids in (pair.chosen_ids, pair.rejected_ids):",
        "tests": ["tests/unit/test_ref_cache_key.py"],
    },
    {
        "name": "dpo-margin-metric-without-beta",
        "why": "the reported margin is the raw log-ratio difference, not beta times it (the loss is right, the logs "
               "are not)",
        "file": "megatron_prune/dpo/loss.py",
        "old": '"margin": margin.detach(),',
        "new": '"margin": (chosen - rejected).detach(),',
        "tests": ["tests/distributed/test_dpo_objective.py::test_pruning_off_equals_independent_reference"],
    },
    {
        "name": "dpo-reward-metrics-swapped",
        "why": "chosen_reward reports the rejected responses' reward",
        "file": "megatron_prune/dpo/loss.py",
        "old": '"chosen_reward": beta * chosen.detach(),',
        "new": '"chosen_reward": beta * rejected.detach(),',
        "tests": ["tests/distributed/test_dpo_objective.py::test_pruning_off_equals_independent_reference"],
    },
    {
        "name": "dpo-ref-cache-key-by-hf-path",
        "why": "the reference cache names an HF reference by its path: new weights written there reuse the table "
               "of the old ones, and a copy of the same weights elsewhere recomputes it",
        "file": "megatron_prune/dpo/trainer.py",
        "old": 'return "hf:" + hf_fingerprint(ref_meta["reference_hf_model"], full=True)',
        "new": 'return "hf:" + ref_meta["reference_hf_model"]',
        "tests": ["tests/unit/test_ref_cache_key.py"],
    },
    {
        "name": "dpo-ref-cache-key-ignores-the-lora-base",
        "why": "under LoRA the cache key leaves out the base the adapter-off policy scores with: two bases of one "
               "architecture share a table",
        "file": "megatron_prune/dpo/trainer.py",
        "old": '        record = json.dumps({k: v for k, v in lora_base.items() if k != "path"}, sort_keys=True)\n',
        "new": '        return "initialisation"\n',
        "tests": ["tests/unit/test_ref_cache_key.py"],
    },
    {
        "name": "dpo-ref-cache-key-holds-the-lora-base-path",
        "why": "under LoRA the cache key holds the base's path: a moved copy of the same base scores the table again",
        "file": "megatron_prune/dpo/trainer.py",
        "old": '        record = json.dumps({k: v for k, v in lora_base.items() if k != "path"}, sort_keys=True)\n',
        "new": "        record = json.dumps(lora_base, sort_keys=True)\n",
        "tests": ["tests/unit/test_ref_cache_key.py"],
    },
    {
        "name": "dpo-ref-cache-key-ignores-precision",
        "why": "the reference cache key leaves out the precision: a table scored under --bf16 is reused by an fp32 "
               "run (or the other way round), so the step-0 log-ratio is not 0",
        "file": "megatron_prune/dpo/trainer.py",
        "old": "{initialised}|{'bf16' if bf16 else 'fp32'}",
        "new": "{initialised}",
        "tests": ["tests/unit/test_ref_cache_key.py"],
    },
    {
        "name": "dpo-sequence-pruning-keeps-suffix",
        "why": "sequence pruning keeps each response's last tokens, scored without the context that was cut",
        "file": "megatron_prune/dpo/batch.py",
        "old": "        responses.append(list(ids[:kept]))\n",
        "new": "        responses.append(list(ids[len(ids) - kept:]))\n",
        "tests": ["tests/unit/test_dpo_microbatches.py::test_sequence_pruning_keeps_a_prefix_of_each_response"],
    },
    {
        "name": "dpo-prefix-rounds-down",
        "why": "the kept prefix rounds down: under sequence pruning the response's last token (EOS) is never scored",
        "file": "megatron_prune/sampling.py",
        "old": "    return max(1, min(length, math.ceil(rho * length)))",
        "new": "    return max(1, min(length, int(rho * length)))",
        "tests": ["tests/unit/test_dpo_microbatches.py::test_prefix_length_is_the_ceiling_of_rho_times_length"],
    },
    {
        "name": "dpo-reference-table-every-rank-same-pairs",
        "why": "every data-parallel rank precomputes the reference log-probs of the same pairs: the others' are missing",
        "file": "megatron_prune/dpo/trainer.py",
        "old": "        mine = chunk[dp_rank::dp]\n        shares.append(",
        "new": "        mine = chunk[:per_rank]\n        shares.append(",
        "tests": ["tests/distributed/test_dpo_reference_table_layouts.py::"
                  "test_the_reference_table_is_the_single_rank_one[moe-ep2-uneven-data]"],
    },
    {
        "name": "dpo-sum-coefficient-full-length",
        "why": "under --dpo-logp-reduction sum with sequence pruning, c_r = T_r/|S_r| takes the length before "
               "pruning, which inflates every log-ratio by T_full/T_kept",
        "file": "megatron_prune/dpo/batch.py",
        "old": "responses.append(Response(plan_i, branch, len(scored), len(plan.responses[branch])))",
        "new": "responses.append(Response(plan_i, branch, len(scored), plan.full_lengths[branch]))",
        "tests": ["tests/distributed/test_dpo_objective.py::test_sequence_pruning_is_dpo_on_the_kept_prefixes"],
    },
    {
        "name": "dpo-pack-rows-drops-the-router-padding-mask",
        "why": "--dpo-pack-rows forgets which tokens are padding or a pruned branch, so a MoE model's router "
               "losses count them",
        "file": "megatron_prune/dpo/batch.py",
        "old": "padding_mask[0, start : start + n] = batch.padding_mask[r, :n] if batch.padding_mask is not None else False",
        "new": "padding_mask[0, start : start + n] = False",
        "tests": ["tests/unit/test_dpo_microbatches.py::test_packed_rows_keep_the_router_padding_mask"],
    },
    {
        "name": "dpo-eval-on-training-pairs",
        "why": "held-out evaluation draws its pairs from the training data (a copy of train_step)",
        "file": "megatron_prune/dpo/trainer.py",
        "old": "self._my_samples(indices, self.eval_dataset), forward_only=True)",
        "new": "self._my_samples(indices, self.dataset), forward_only=True)",
        "tests": ["tests/e2e/test_user_paths.py::test_evaluation_is_unpruned_dpo_on_the_heldout_pairs"],
    },
    {
        "name": "dpo-eval-runs-pruned",
        "why": "the evaluation runner gets the training step's pruning: held-out metrics become pruned estimates",
        "file": "megatron_prune/dpo/trainer.py",
        "old": "        eval_runner = DPOStep(settings=off, policy=parts.model, reference=reference)\n",
        "new": "        eval_runner = DPOStep(settings=settings, policy=parts.model, reference=reference)\n",
        "tests": ["tests/e2e/test_user_paths.py::test_evaluation_is_unpruned_dpo_on_the_heldout_pairs"],
    },
    {
        "name": "dpo-token-counters-one-rank-only",
        "why": "DPO's token counters (policy_tokens, train_tokens, ...) are this data-parallel rank's share only",
        "file": "megatron_prune/dpo/step.py",
        "old": "            dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())\n        return {n: float(v)",
        "new": "            pass\n        return {n: float(v)",
        "tests": ["tests/distributed/test_dpo.py::test_layouts_match_single_rank_2_ranks"],
    },
    {
        "name": "dpo-branch-weight-scales-reported-loss",
        "why": "the branch-pruning weight 1/q multiplies the loss's value as well as its gradient: the reported "
               "loss is the weighted one, not the unpruned objective's per-pair mean the docs promise",
        "file": "megatron_prune/dpo/loss.py",
        "old": "        loss = loss.detach() + (loss - loss.detach()) * grad_scale\n",
        "new": "        loss = loss * grad_scale\n",
        "tests": ["tests/distributed/test_dpo_metrics.py::test_branch_pruning_reports_the_unweighted_metrics"],
    },
]
