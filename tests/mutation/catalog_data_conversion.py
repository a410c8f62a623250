"""Seeded bugs of the data readers (preference records, record files, packing), the HF weight
mapping and conversion helpers, and checkpoint save/restore, each with the tests that must catch it.

Format: ``tools/mutants.py`` (``MUTANTS``: name, why, file, old, new, tests).
"""

from __future__ import annotations

PREFERENCE = "megatron_prune/data/preference.py"
RECORDS = "megatron_prune/data/records.py"
PACKING = "megatron_prune/data/packing.py"
HF_MAPPING = "megatron_prune/model/hf_mapping.py"
HF_CONVERT = "megatron_prune/model/hf_convert.py"
CHECKPOINT = "megatron_prune/training/checkpoint.py"

PREF_TESTS = "tests/unit/data/test_preference.py"
PACKING_TESTS = "tests/unit/test_packing.py"
HF_TESTS = "tests/unit/model/test_hf_mapping.py"
CKPT_TESTS = "tests/unit/test_checkpoint_atomic.py"

MUTANTS: list[dict] = [
    {
        "name": "rope-scaling-on-for-any-rope-dict",
        "why": "the model builds Llama-3 RoPE scaling whenever the architecture holds a rope dict, also one of the "
               "default type ({'rope_type': 'default'}): wrong logits for such a config.json",
        "file": "megatron_prune/model/provider.py",
        "old": 'rope_scaling=scaling.get("rope_type", scaling.get("type")) == "llama3",',
        "new": "rope_scaling=bool(scaling),",
        "tests": ["tests/distributed/test_hf_conversion.py::test_a_rope_dict_of_the_default_type_builds_plain_rope"],
    },
    {
        "name": "rope-theta-top-level-wins",
        "why": "a config.json giving rope_theta twice, at the top level and in rope_parameters, is read with the "
               "top-level value, where transformers reads rope_parameters': a different model, without a word",
        "file": "megatron_prune/model/arch.py",
        "old": "    if theta is not None and inner is not None and float(theta) != float(inner):",
        "new": "    if False:",
        "tests": ["tests/unit/model/test_hf_mapping.py::test_rope_fields_are_read_as_transformers_reads_them"],
    },
    # --- preference records -------------------------------------------------------------------
    {
        "name": "pref-prompt-head-kept-when-it-fills-the-budget",
        "why": "a prompt whose template head is as long as max_prompt_length keeps only the head (no text of "
               "the prompt at all) instead of its last max_prompt_length tokens",
        "file": PREFERENCE,
        "old": "    if keep_head >= max_length:\n",
        "new": "    if keep_head > max_length:\n",
        "tests": [f"{PREF_TESTS}::test_truncation_rule",
                  f"{PREF_TESTS}::test_prompt_head_is_kept_only_with_room_for_prompt_text"],
    },
    {
        "name": "pref-no-room-for-a-response-accepted",
        "why": "a prompt that fills max_seq_length is not refused as 'prompt too long': both responses are cut "
               "to nothing and the record is misreported as 'identical responses'",
        "file": PREFERENCE,
        "old": "    if budget < 1:\n",
        "new": "    if budget < 0:\n",
        "tests": [f"{PREF_TESTS}::test_truncation_rule"],
    },
    {
        "name": "pref-helpsteer3-preference-inverted",
        "why": "HelpSteer3's overall_preference is read with the wrong sign: negative (response1 better) "
               "makes response2 the chosen one",
        "file": PREFERENCE,
        "old": "(response1, response2) if preference < 0 else (response2, response1)",
        "new": "(response1, response2) if preference > 0 else (response2, response1)",
        "tests": [f"{PREF_TESTS}::test_helpsteer3"],
    },
    {
        "name": "pref-every-pair-counted-as-truncated",
        "why": "the truncation counter counts parts that lost no token (<= instead of <)",
        "file": PREFERENCE,
        "old": "if len(after) < len(before))",
        "new": "if len(after) <= len(before))",
        "tests": [f"{PREF_TESTS}::test_truncation_is_counted_and_logged"],
    },
    {
        "name": "pref-tie-raises-without-skip-invalid",
        "why": "a HelpSteer3 tie goes through the strict policy like a broken record: without --skip-invalid "
               "the run stops on a valid record",
        "file": PREFERENCE,
        "old": "                policy.skip(record_error(source, line, exc))\n",
        "new": "                policy.handle(record_error(source, line, exc))\n",
        "tests": [f"{PREF_TESTS}::test_helpsteer3_tie_is_always_a_counted_skip"],
    },
    {
        "name": "pref-hh-split-at-first-assistant-turn",
        "why": "an HH-RLHF transcript is cut at its first assistant turn, so a multi-turn dialogue's later "
               "turns end up in the response",
        "file": PREFERENCE,
        "old": "    cut = transcript.rfind(PLAIN_GENERATION_PROMPT)\n",
        "new": "    cut = transcript.find(PLAIN_GENERATION_PROMPT)\n",
        "tests": [f"{PREF_TESTS}::test_hh_split", f"{PREF_TESTS}::test_hh_split_on_real_bundled_records"],
    },
    {
        "name": "pref-repeated-prompt-cut-from-one-response",
        "why": "the repeated prompt is cut when only one of the two string responses starts with it, so a "
               "response that merely begins with the prompt's words loses them",
        "file": PREFERENCE,
        "old": "and chosen.startswith(prompt) and rejected.startswith(prompt)):",
        "new": "and (chosen.startswith(prompt) or rejected.startswith(prompt))):",
        "tests": [f"{PREF_TESTS}::test_explicit_string_response_that_only_begins_like_the_prompt_is_kept"],
    },
    {
        "name": "pref-hh-response-keeps-template-space",
        "why": "an HH-RLHF response keeps the space the plain template puts after 'Assistant:', so the "
               "rendered response carries it twice",
        "file": PREFERENCE,
        "old": "_drop_one_space(response_c), _drop_one_space(response_r))",
        "new": "response_c, response_r)",
        "tests": [f"{PREF_TESTS}::test_hh_split", f"{PREF_TESTS}::test_hh_first_record_by_hand"],
    },
    {
        "name": "pref-prompt-truncation-drops-bos",
        "why": "left truncation of a long prompt keeps no template head: BOS and the chat preamble are cut",
        "file": PREFERENCE,
        "old": "keep_head=prompt_head(tokenizer, text.prompt, prompt_ids) if too_long else 0,",
        "new": "keep_head=0,",
        "tests": [f"{PREF_TESTS}::test_truncation_on_tokenized_pairs"],
    },
    {
        "name": "pref-prompt-head-from-a-one-message-probe",
        "why": "the kept head is measured on a one-user-message probe: a template that adds a default system "
               "prompt keeps the start of a prompt's own user text as head",
        "file": PREFERENCE,
        "old": "keep_head=prompt_head(tokenizer, text.prompt, prompt_ids) if too_long else 0,",
        "new": "keep_head=prompt_head_length(tokenizer) if too_long else 0,",
        "tests": [f"{PREF_TESTS}::test_prompt_head_is_measured_on_the_prompts_own_messages"],
    },
    {
        "name": "pref-prompt-truncation-keeps-a-cut-character",
        "why": "a prompt cut from the left inside a character that byte-fallback or byte-level tokenizers spell "
               "with several tokens starts with that character's orphan bytes (decoded: U+FFFD)",
        "file": PREFERENCE,
        "old": "                         decode=tokenizer.decode)",
        "new": "                         decode=None)",
        "tests": ["tests/unit/data/test_preference_edge_cases.py::test_left_truncated_prompt_starts_on_a_whole_character"],
    },
    # --- record files -------------------------------------------------------------------------
    {
        "name": "records-json-array-numbered-from-zero",
        "why": "the elements of a JSON-array file are numbered from 0, so errors name the wrong record",
        "file": RECORDS,
        "old": "for number, record in enumerate(records, start=1):",
        "new": "for number, record in enumerate(records):",
        "tests": [PREF_TESTS],
    },
    {
        "name": "records-bom-kept-on-first-line",
        "why": "a UTF-8 byte order mark is not removed from the first line of a JSON Lines file, which then "
               "fails to parse",
        "file": RECORDS,
        "old": "        if line_no == 1:\n",
        "new": "        if line_no == 0:\n",
        "tests": [f"{PREF_TESTS}::test_utf8_byte_order_mark_is_ignored"],
    },
    # --- packing ------------------------------------------------------------------------------
    {
        "name": "packing-exact-fit-refused",
        "why": "a sequence that exactly fills a row's remaining room opens a new row (< instead of <=)",
        "file": PACKING,
        "old": "if r.used + checked[index] <= capacity), None)",
        "new": "if r.used + checked[index] < capacity), None)",
        "tests": [f"{PACKING_TESTS}::test_window_sorting_beats_plain_first_fit_and_carrying_rows_helps",
                  f"{PACKING_TESTS}::test_every_sequence_placed_once_and_rows_fit"],
    },
    {
        "name": "packing-window-sorted-shortest-first",
        "why": "a window is sorted shortest first (first-fit increasing), which packs worse",
        "file": PACKING,
        "old": "key=lambda i: (-checked[i], i)",
        "new": "key=lambda i: (checked[i], i)",
        "tests": [f"{PACKING_TESTS}::test_window_sorting_beats_plain_first_fit_and_carrying_rows_helps"],
    },
    {
        "name": "packing-cu-seqlens-padded-empty-segment",
        "why": "a full row (no padding) gets a zero-length padding segment appended to its padded cu_seqlens",
        "file": PACKING,
        "old": "    if include_padding and row.padding:\n",
        "new": "    if include_padding:\n",
        "tests": [f"{PACKING_TESTS}::test_row_tensors",
                  f"{PACKING_TESTS}::test_cu_seqlens_of_a_full_row_has_no_empty_padding_segment"],
    },
    # --- HF mapping ---------------------------------------------------------------------------
    {
        "name": "hf-qk-norm-swapped",
        "why": "Qwen3's q_norm and k_norm weights are mapped onto each other's Megatron tensor (a symmetric "
               "swap: the round trip stays bit-identical)",
        "file": HF_MAPPING,
        "old": "        rules.append(rule(Q_NORM, [attn + \"q_norm.weight\"], [(d,)], (d,)))\n"
               "        rules.append(rule(K_NORM, [attn + \"k_norm.weight\"], [(d,)], (d,)))\n",
        "new": "        rules.append(rule(Q_NORM, [attn + \"k_norm.weight\"], [(d,)], (d,)))\n"
               "        rules.append(rule(K_NORM, [attn + \"q_norm.weight\"], [(d,)], (d,)))\n",
        "tests": [f"{HF_TESTS}::test_qk_norm_weights_map_by_name"],
    },
    {
        "name": "hf-padded-vocab-adds-a-block-when-divisible",
        "why": "a vocabulary that is already a multiple of the padding gets one more block of padding rows",
        "file": HF_MAPPING,
        "old": "    return -(-vocab_size // multiple) * multiple\n",
        "new": "    return (vocab_size // multiple + 1) * multiple\n",
        "tests": [f"{HF_TESTS}::test_padded_vocab_size_is_the_next_multiple"],
    },
    {
        "name": "hf-config-from-arch-drops-head-dim",
        "why": "the config made for an export without the original config.json leaves head_dim out, so a "
               "model whose head_dim is not hidden_size / num_attention_heads (Qwen3) loads with the wrong one",
        "file": HF_MAPPING,
        "old": "        \"head_dim\": arch.head_dim,\n",
        "new": "",
        "tests": [f"{HF_TESTS}::test_config_made_from_arch_describes_the_same_model",
                  f"{HF_TESTS}::test_config_made_from_arch_keeps_non_default_norm_eps_and_head_dim"],
    },
    {
        "name": "hf-config-from-arch-drops-rms-norm-eps",
        "why": "the config made from the architecture leaves rms_norm_eps out, so transformers' default is used",
        "file": HF_MAPPING,
        "old": "        \"rms_norm_eps\": arch.rms_norm_eps,\n",
        "new": "",
        "tests": [f"{HF_TESTS}::test_config_made_from_arch_keeps_non_default_norm_eps_and_head_dim"],
    },
    # --- HF conversion helpers ----------------------------------------------------------------
    {
        "name": "hf-shard-split-at-exactly-the-limit",
        "why": "a shard whose tensors add up to exactly --max-shard-size is split (>= instead of >)",
        "file": HF_CONVERT,
        "old": "if groups[-1] and size + nbytes > max_shard_bytes:",
        "new": "if groups[-1] and size + nbytes >= max_shard_bytes:",
        "tests": [f"{HF_TESTS}::test_shard_may_reach_exactly_the_size_limit"],
    },
    {
        "name": "hf-parse-size-units-swapped",
        "why": "GB is read as binary and GiB as decimal",
        "file": HF_CONVERT,
        "old": "    base = 1024 if \"I\" in unit else 1000\n",
        "new": "    base = 1000 if \"I\" in unit else 1024\n",
        "tests": [f"{HF_TESTS}::test_parse_size"],
    },
    {
        "name": "hf-compare-kl-reversed",
        "why": "the comparison reports KL(Megatron || HF) under the name KL(HF || Megatron)",
        "file": HF_CONVERT,
        "old": "    kl = (log_p.exp() * (log_p - log_q)).sum(-1)\n",
        "new": "    kl = (log_q.exp() * (log_q - log_p)).sum(-1)\n",
        "tests": [f"{HF_TESTS}::test_compare_logits_kl_is_hf_to_megatron"],
    },
    {
        "name": "hf-auto-dtype-ignores-torch-dtype",
        "why": "--dtype auto reads only the newer 'dtype' key of config.json, so a config that declares "
               "torch_dtype bfloat16 converts to fp32",
        "file": HF_CONVERT,
        "old": "    declared = config.get(\"dtype\") or config.get(\"torch_dtype\")\n",
        "new": "    declared = config.get(\"dtype\")\n",
        "tests": [f"{HF_TESTS}::test_auto_dtype_reads_either_config_key"],
    },
    # --- checkpoints --------------------------------------------------------------------------
    {
        "name": "checkpoint-torch-rng-not-restored",
        "why": "a resume does not restore the saved torch RNG state, so dropout and any CPU draw differ from "
               "the uninterrupted run",
        "file": CHECKPOINT,
        "old": "        torch.set_rng_state(mine[\"torch\"])\n",
        "new": "",
        "tests": [f"{CKPT_TESTS}::test_resume_restores_the_rng_states_saved_with_the_checkpoint"],
    },
    {
        "name": "checkpoint-rng-tracker-not-restored",
        "why": "a resume does not restore Megatron's model-parallel RNG tracker states (tensor-parallel "
               "dropout streams)",
        "file": CHECKPOINT,
        "old": "        _set_rng_tracker_states(mine[\"tracker\"])\n",
        "new": "",
        "tests": [f"{CKPT_TESTS}::test_resume_restores_the_rng_states_saved_with_the_checkpoint"],
    },
    {
        "name": "checkpoint-device-rng-not-restored",
        "why": "a resume on a GPU does not restore the device's default generator, so LoRA dropout masks start "
               "over from the launch's seed",
        "file": CHECKPOINT,
        "old": "        _set_device_rng_state(mine.get(\"device\"))\n",
        "new": "",
        "tests": [f"{CKPT_TESTS}::test_resume_restores_the_devices_own_generator"],
    },
    {
        "name": "checkpoint-resave-deletes-the-old-directory-in-place",
        "why": "a re-save of an existing iteration deletes the old directory where it stands: a kill mid-delete "
               "leaves its meta.json and index without shards, which pass for a complete checkpoint",
        "file": CHECKPOINT,
        "old": "        os.replace(final, aside)\n",
        "new": "        shutil.rmtree(final)\n",
        "tests": [f"{CKPT_TESTS}::test_resaving_an_iteration_never_leaves_a_partial_checkpoint_in_place"],
    },
    {
        "name": "checkpoint-always-claims-optimizer-state",
        "why": "meta.json says has_optimizer even when no optimizer was saved, so resuming a converted model "
               "is not refused",
        "file": CHECKPOINT,
        "old": "\"has_optimizer\": optimizer is not None,",
        "new": "\"has_optimizer\": True,",
        "tests": [f"{CKPT_TESTS}::test_checkpoint_saved_without_an_optimizer_refuses_to_resume_one"],
    },
    {
        "name": "rng-restored-at-another-layout",
        "why": "a resume at another layout of the same world size gives rank k the generator states of the "
               "saving layout's rank k: TP ranks of one replicated LoRA adapter drop out differently and drift apart",
        "file": CHECKPOINT,
        "old": "    if not ps.model_parallel_is_initialized():\n",
        "new": "    if True:\n",
        "tests": ["tests/distributed/test_checkpoint_reshard.py::"
                  "test_rank_generators_are_restored_at_the_saving_layout_only"],
    },
    {
        "name": "bf16-weights-only-load-undone-by-the-first-step",
        "why": "under --bf16 a --finetune or converted-checkpoint load leaves the optimizer's fp32 main weights at "
               "the initialisation: the first step writes them back over the loaded model",
        "file": "megatron_prune/training/loop.py",
        "old": "        parts.optimizer.reload_model_params()\n",
        "new": "",
        "tests": ["tests/e2e/test_user_paths.py::test_bf16_finetune_trains_the_loaded_weights"],
    },
    {
        "name": "checkpoint-scan-picks-oldest",
        "why": "without a usable tracker file the oldest complete iter_* directory is loaded, not the newest",
        "file": CHECKPOINT,
        "old": "    chosen = os.path.join(root, complete[-1]) if complete else None\n",
        "new": "    chosen = os.path.join(root, complete[0]) if complete else None\n",
        "tests": [f"{CKPT_TESTS}::test_no_tracker_scans_for_newest_complete"],
    },
    {
        "name": "chat-template-frame-ignores-the-prompt",
        "why": "a response is framed with the last prompt's generation prompt whatever its own prompt, so the "
               "first response of each new prompt is its bare content",
        "file": "megatron_prune/data/tokenizer.py",
        "old": "        if self._last_frame is not None and self._last_frame[0] == prompt:\n",
        "new": "        if self._last_frame is not None:\n",
        "tests": ["tests/unit/data/test_tokenizer.py::test_each_prompt_is_framed_once_for_its_pair"],
    },
    {
        "name": "chat-template-kwargs-not-passed",
        "why": "--chat-template-kwargs never reaches the template: Qwen3 prompts stay in thinking mode",
        "file": "megatron_prune/data/tokenizer.py",
        "old": "                **self.chat_template_kwargs,\n",
        "new": "",
        "tests": ["tests/unit/data/test_tokenizer.py", "tests/unit/grpo/test_math_prompts.py"],
    },
    {
        "name": "all-skipped-file-called-empty",
        "why": "under --skip-invalid-records a file whose every record was skipped is refused as an empty data file",
        "file": "megatron_prune/data/records.py",
        "old": "        before = len(items) + policy.total()\n        items.extend(read(path))\n"
               "        records_per_file[os.fspath(path)] = len(items) + policy.total() - before\n",
        "new": "        before = len(items)\n        items.extend(read(path))\n"
               "        records_per_file[os.fspath(path)] = len(items) - before\n",
        "tests": ["tests/unit/data/test_preference.py::test_a_file_whose_records_are_all_skipped_is_counted_not_called_empty"],
    },
    {
        "name": "sampler-resumes-another-order",
        "why": "a saved position of the shuffled order resumes in the file's own order (or the reverse)",
        "file": "megatron_prune/data/sampler.py",
        "old": "for key in (\"seed\", \"num_samples\", \"shuffle\"):",
        "new": "for key in (\"seed\", \"num_samples\"):",
        "tests": ["tests/unit/data/test_sampler.py::test_sampler_refuses_a_mismatched_state"],
    },
    {
        "name": "plain-template-empty-turn-gets-a-space",
        "why": "an empty turn renders as the marker plus a space, which the HH parser does not give back",
        "file": "megatron_prune/data/tokenizer.py",
        "old": "        parts.append(PLAIN_ROLE_MARKERS[message[\"role\"]] + (\" \" + content if content else \"\"))\n",
        "new": "        parts.append(PLAIN_ROLE_MARKERS[message[\"role\"]] + \" \" + content)\n",
        "tests": ["tests/unit/data/test_preference.py::test_hh_transcripts_round_trip_with_their_whitespace"],
    },
    {
        "name": "hh-turns-stripped",
        "why": "HH-RLHF turns lose all their surrounding whitespace, not just the template's one space",
        "file": "megatron_prune/data/preference.py",
        "old": "        messages.append({\"role\": role, \"content\": _drop_one_space(body[start:position])})\n",
        "new": "        messages.append({\"role\": role, \"content\": body[start:position].strip()})\n",
        "tests": ["tests/unit/data/test_preference.py::test_hh_transcripts_round_trip_with_their_whitespace"],
    },
    {
        "name": "checkpoint-format-not-checked",
        "why": "a directory of another checkpoint format is read as ours",
        "file": "megatron_prune/training/checkpoint.py",
        "old": "    if meta.get(\"format\") != FORMAT:\n",
        "new": "    if False:\n",
        "tests": ["tests/unit/test_checkpoint_atomic.py::test_a_checkpoint_of_another_format_is_refused"],
    },
    {
        "name": "sampler-deferred-dropped-when-not-distinct",
        "why": "a resume at a batch size that turns distinct requests off never serves the indices a distinct request "
               "deferred, so one epoch skips them",
        "file": "megatron_prune/data/sampler.py",
        "old": "        # belong to this epoch's visit, so they come first here too.\n"
               "        indices, self.deferred = self.deferred[:count], self.deferred[count:]\n",
        "new": "        indices: list[int] = []\n",
        "tests": ["tests/unit/data/test_sampler.py::test_a_resume_that_turns_distinct_off_serves_the_deferred_indices_first"],
    },
    {
        "name": "hf-absent-head-dim-from-hidden",
        "why": "a Qwen3 config.json without head_dim is read as hidden_size / heads, not transformers' 128: the "
               "conversion fails on a tensor's shape instead of building the model transformers builds",
        "file": "megatron_prune/model/arch.py",
        "old": "    \"qwen3\": {\"head_dim\": 128, \"num_key_value_heads\": 32},\n",
        "new": "    \"qwen3\": {\"num_key_value_heads\": 32},\n",
        "tests": ["tests/unit/model/test_hf_mapping.py::test_a_missing_attention_size_is_read_as_transformers_reads_it"],
    },
]
