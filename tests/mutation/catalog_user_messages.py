"""Seeded bugs of what a user is told: dead-flag warnings, launch checks, signal handling and skip messages, each with the tests that must catch it.

Format: ``tools/mutants.py`` (``MUTANTS``: name, why, file, old, new, tests).
"""

from __future__ import annotations

DEAD_FLAGS = "megatron_prune/training/dead_flags.py"
EXIT = "megatron_prune/training/exit_conditions.py"
SESSION = "megatron_prune/training/session.py"
LOOP = "megatron_prune/training/loop.py"
T_DEAD = "tests/e2e/test_dead_flags.py"
WARNS = f"{T_DEAD}::test_an_ignored_flag_is_said_in_one_line_and_the_run_goes_on"
QUIET = f"{T_DEAD}::test_defaults_presets_and_flags_in_use_warn_nothing"

MUTANTS: list[dict] = [
    {"name": "dead-adam-beta1-unwarned",
     "why": "--adam-beta1 with --optimizer sgd passes silently",
     "file": DEAD_FLAGS, "old": 'Rule(("TrainConfig.adam_beta1", "TrainConfig.adam_beta2"),',
     "new": 'Rule(("TrainConfig.adam_beta2",),', "tests": [f"{WARNS}[adam-beta1-with-sgd]"]},
    {"name": "dead-clip-eps-low-unwarned",
     "why": "--clip-eps-low with one update per rollout passes silently",
     "file": DEAD_FLAGS, "old": 'Rule(("GRPOConfig.clip_eps_low", "GRPOConfig.clip_eps_high"),',
     "new": 'Rule(("GRPOConfig.clip_eps_high",),', "tests": [f"{WARNS}[clip-low-with-one-update]"]},
    {"name": "dead-toy-num-prompts-unwarned",
     "why": "--toy-num-prompts with --task gsm8k passes silently",
     "file": DEAD_FLAGS,
     "old": 'Rule(("GRPOConfig.toy_num_prompts", "GRPOConfig.toy_num_digits", "GRPOConfig.toy_prompt_length"),',
     "new": 'Rule(("GRPOConfig.toy_num_digits", "GRPOConfig.toy_prompt_length"),',
     "tests": [f"{WARNS}[toy-num-prompts-on-gsm8k]"]},
    {"name": "dead-override-scheduler-judged-on-load-only",
     "why": "--override-opt-param-scheduler with a weights-only --load (which resumes no schedule) is not warned",
     "file": DEAD_FLAGS, "old": "         lambda s: not s.resumes,\n         \"has no effect: the run resumes no learning-rate",
     "new": "         lambda s: not s.ckpt.load,\n         \"has no effect: the run resumes no learning-rate",
     "tests": [f"{T_DEAD}::test_ignored_reference_and_finetune_flags"]},
    {"name": "dead-layers-per-chunk-ignores-vpp",
     "why": "block recompute past a model chunk under the interleaved schedule is not warned",
     "file": DEAD_FLAGS,
     "old": "return self.arch.num_layers // (m.pipeline_model_parallel_size * (m.virtual_pipeline_model_parallel_size or 1))",
     "new": "return self.arch.num_layers // m.pipeline_model_parallel_size",
     "tests": [f"{T_DEAD}::test_block_recompute_is_judged_per_model_chunk_under_the_interleaved_schedule"]},
    {"name": "dead-min-lr-judged-on-resume",
     "why": "a resume (which keeps the checkpoint's schedule) is told --min-lr has no effect with the default constant style",
     "file": DEAD_FLAGS, "old": 'lambda s: s.schedule_from_flags and s.train.lr_decay_style == "constant",',
     "new": 'lambda s: s.train.lr_decay_style == "constant",',
     "tests": [f"{T_DEAD}::test_schedule_flags_of_a_resume_are_not_judged"]},
    {"name": "dead-skip-zero-advantage-warned-at-kl-0",
     "why": "an explicit --skip-zero-advantage at --kl-beta 0 is told that a KL term gives every completion a gradient",
     "file": DEAD_FLAGS, "old": 'Rule(("DPPOArgs.skip_zero_advantage",), lambda s: s.grpo.kl_beta > 0,',
     "new": 'Rule(("DPPOArgs.skip_zero_advantage",), lambda s: s.grpo.kl_beta >= 0,',
     "tests": [f"{QUIET}[skip-zero-advantage-without-kl]"]},
    {"name": "recording-handler-not-restored-on-error",
     "why": "after an exception inside the block the recording handler stays installed: a later signal is swallowed",
     "file": EXIT, "old": "    try:\n        yield\n    finally:\n        _open_blocks -= 1\n        signal.signal(sig, previous)\n",
     "new": "    yield\n    _open_blocks -= 1\n    signal.signal(sig, previous)\n",
     "tests": ["tests/unit/test_exit_conditions.py::"
               "test_a_run_that_fails_inside_the_block_leaves_the_old_handler_and_no_signal_behind"]},
    {"name": "interleaved-microbatches-counted-per-chunk",
     "why": "the interleaved-schedule check wants a multiple of the model chunks, not of the pipeline stages",
     "file": SESSION, "old": "if vpp > 1 and (microbatches < pp or microbatches % pp):",
     "new": "if vpp > 1 and (microbatches < vpp or microbatches % vpp):",
     "tests": ["tests/unit/test_interleaved_microbatches.py"]},
    {"name": "nonfinite-skipped-range-off-by-one",
     "why": "the 'steps a..b were skipped' range of the ten-in-a-row stop starts one step early",
     "file": LOOP, "old": "batch: steps {step + 2 - skipped_in_a_row}..{step + 1} were skipped)",
     "new": "batch: steps {step + 1 - skipped_in_a_row}..{step + 1} were skipped)",
     "tests": ["tests/e2e/test_nonfinite.py::test_skipping_stops_after_ten_non_finite_steps_in_a_row"]},
    {"name": "world-size-zero-accepted",
     "why": "WORLD_SIZE=0 passes the launch check and fails later with a ZeroDivisionError traceback",
     "file": "megatron_prune/training/parallel.py", "old": "if not text.strip().isdigit() or int(text) < 1:",
     "new": "if not text.strip().isdigit() or int(text) < 0:",
     "tests": ["tests/e2e/test_flags.py::test_a_malformed_world_size_is_one_line"]},
    {"name": "hf-model-file-accepted",
     "why": "--hf-model naming a file passes the launch check, and the error then names the converter's --hf-dir",
     "file": SESSION, "old": "if model.hf_model and not os.path.isdir(model.hf_model):",
     "new": "if model.hf_model and not os.path.exists(model.hf_model):",
     "tests": ["tests/e2e/test_flags.py::test_an_hf_model_that_is_a_file_is_named"]},
    {"name": "device-error-said-on-the-first-node-only",
     "why": "a device that cannot start is printed by global rank 0 only and never reaches torchrun's report, so "
            "a node without the device exits 2 in silence",
     "file": "megatron_prune/training/cli.py",
     "old": "            fail_usage(exc)  # every node's first rank says it",
     "new": "            print(f\"megatron-prune: error: {exc}\", file=sys.stderr) if first_rank() else None; sys.exit(2)  #",
     "tests": ["tests/unit/test_device_error_on_every_node.py"]},
]
