"""Seeded bugs of checkpointing and resume (what is saved, what a resume applies, where a run may save),
each with the tests that must catch it.

Format: ``tools/mutants.py`` (``MUTANTS``: name, why, file, old, new, tests).
"""

from __future__ import annotations

CHECKPOINT = "megatron_prune/training/checkpoint.py"
LOOP = "megatron_prune/training/loop.py"
SESSION = "megatron_prune/training/session.py"
ATOMIC = "tests/unit/test_checkpoint_atomic.py"
SAME_DIRECTORY = f"{ATOMIC}::test_save_and_load_of_one_directory_start_fresh_until_it_holds_a_checkpoint"
INSIDE_SAVE = f"{ATOMIC}::test_load_of_a_checkpoint_inside_the_save_directory_resumes_it"
OWN_FOLDER = "tests/e2e/test_flags.py::test_a_new_run_from_a_checkpoint_into_its_own_folder_is_refused"
SGD_MOMENTUM = ("tests/unit/test_optimizer_flags_on_resume.py::"
                "test_a_changed_sgd_momentum_applies_after_the_checkpoints_state_is_loaded")

MUTANTS: list[dict] = [
    {
        "name": "resume-keeps-the-checkpoints-sgd-momentum",
        "why": "loading an SGD optimizer restores the checkpoint's momentum; a changed --sgd-momentum is named "
               "but not used",
        "file": LOOP,
        "old": "            if \"momentum\" in group:\n                group[\"momentum\"] = config.sgd_momentum\n",
        "new": "",
        "tests": [SGD_MOMENTUM],
    },
    {
        "name": "finetune-into-its-source-subdir-allowed",
        "why": "--finetune --load X/iter_N --save X is let through: the new run at iteration 0 replaces the "
               "source run's checkpoints of the same iterations",
        "file": SESSION,
        "old": "    if load != save and not load.startswith(save + os.sep):\n",
        "new": "    if load != save:\n",
        "tests": [OWN_FOLDER],
    },
    {
        "name": "resume-load-inside-save-refused",
        "why": "--save X --load X/iter_N (resuming an earlier checkpoint of the same run) is refused as another "
               "run's checkpoint saving among X's",
        "file": CHECKPOINT,
        "old": "if load is not None and save is not None and holds_checkpoint(save) and not inside \\\n",
        "new": "if load is not None and save is not None and holds_checkpoint(save) \\\n",
        "tests": [INSIDE_SAVE],
    },
    {
        "name": "load-beside-save-counted-inside-it",
        "why": "a --load in a sibling whose name starts with --save's (ckpt_other beside ckpt) counts as a "
               "checkpoint of --save: its run saves among another run's checkpoints",
        "file": CHECKPOINT,
        "old": "os.path.realpath(load).startswith(os.path.realpath(save) + os.sep)  # --load X/iter_N --save X",
        "new": "os.path.realpath(load).startswith(os.path.realpath(save))  # --load X/iter_N --save X",
        "tests": [INSIDE_SAVE],
    },
    {
        "name": "another-load-into-a-used-save-allowed",
        "why": "a run from another --load saves into a --save holding checkpoints: its saves land among them",
        "file": CHECKPOINT,
        "old": "        raise CheckpointError(f\"--save {save} already holds checkpoints (newest: {find_latest(save, "
               "flag='--save')}) \"\n                              f\"that this run from --load {load} would "
               "overwrite; choose another --save\")\n",
        "new": "        pass\n",
        "tests": [INSIDE_SAVE],
    },
    {
        "name": "save-load-same-dir-compared-as-strings",
        "why": "--save ckpt with --load ./ckpt, ckpt/ or its absolute path is not seen as one directory: the first "
               "launch of a launch script fails instead of starting fresh",
        "file": CHECKPOINT,
        "old": "if load is not None and save is not None and os.path.realpath(load) == os.path.realpath(save) \\\n",
        "new": "if load is not None and save is not None and load == save \\\n",
        "tests": [SAME_DIRECTORY],
    },
    {
        "name": "distopt-step-tensor-shared-across-params",
        "why": "every parameter gets the one restored Adam step tensor, which torch's Adam then advances once per "
               "parameter and step: the bias correction after a distributed-optimizer resume is wrong",
        "file": CHECKPOINT,
        "old": "                opt.optimizer.state[p][\"step\"] = step.clone()\n",
        "new": "                opt.optimizer.state[p][\"step\"] = step\n",
        "tests": ["tests/e2e/test_resume_distopt.py::test_dpo_distopt_dp2_resume_bit_exact_and_other_layouts"],
    },
    {
        "name": "resume-does-not-restore-rng",
        "why": "a resume never restores the saved generator states: LoRA dropout masks after it differ from the "
               "uninterrupted run's",
        "file": LOOP,
        "old": "optimizer=None if weights_only else parts.optimizer, restore_rng=not weights_only,",
        "new": "optimizer=None if weights_only else parts.optimizer, restore_rng=False,",
        "tests": ["tests/e2e/test_lora_cli.py::test_lora_dpo_kill_resume_and_export"],
    },
    {
        "name": "scheduler-state-not-loaded-under-override",
        "why": "--override-opt-param-scheduler restarts the schedule at step 0 instead of the checkpoint's step",
        "file": LOOP,
        "old": "        parts.scheduler.load_state_dict(loaded[\"scheduler\"])\n",
        "new": "        if not parts.scheduler.override_opt_param_scheduler:\n"
               "            parts.scheduler.load_state_dict(loaded[\"scheduler\"])\n",
        "tests": ["tests/e2e/test_resume.py::"
                  "test_a_run_extended_past_its_decay_is_warned_and_override_decays_over_the_new_horizon"],
    },
    {
        "name": "rollout-metrics-not-saved",
        "why": "a checkpoint inside a rollout keeps none of its reward metrics: the resumed update of that rollout "
               "has none to log (the logging rank fails reading them)",
        "file": "megatron_prune/grpo/trainer.py",
        "old": "\"metrics\": dict(buffer.metrics),",
        "new": "\"metrics\": {},",
        "tests": ["tests/distributed/test_grpo_objective.py::test_state_inside_a_rollout_restores_it_on_every_rank"],
    },
    {
        "name": "rank-0-save-failure-not-shared",
        "why": "a full disk while rank 0 writes trainer_state.pt / meta.json stops rank 0 alone: the other ranks "
               "pass the save as if the checkpoint were published and wait in the next collective",
        "file": CHECKPOINT,
        "old": "    failure = broadcast_object(failure)\n    if failure is not None:\n        raise CheckpointError",
        "new": "    _barrier()\n    if failure is not None:\n        raise CheckpointError",
        "tests": ["tests/unit/test_checkpoint_save_failure_ranks.py::"
                  "test_a_disk_full_in_rank_0s_files_stops_every_rank_with_the_save_error[trainer_state]"],
    },
    {
        "name": "hf-assets-copy-failure-not-shared",
        "why": "a full disk while rank 0 copies the HF config and tokenizer beside the checkpoints stops rank 0 "
               "alone: the other ranks enter the save's collectives and wait for it",
        "file": "megatron_prune/training/loop.py",
        "old": "    ckpt_io.agree_or_raise(failure)\n",
        "new": "    if failure is not None:\n        raise ckpt_io.CheckpointError(failure)\n",
        "tests": ["tests/unit/test_checkpoint_save_failure_ranks.py::"
                  "test_a_failed_copy_of_the_hf_files_stops_every_rank_with_the_save_error"],
    },
]
