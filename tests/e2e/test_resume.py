"""Kill-and-resume: a DPO run killed with SIGKILL and resumed gives the same per-step losses.

Every pruning is on (position α = 0.6, sequence ρ_min = 0.5, branch q = 0.5), so the data
order and the pruning draws after the resume must be the ones the uninterrupted run made.
Launches: one uninterrupted 6-step run (the reference, saving every 2 steps), one run killed
after its third step, its resume, and (slow) a resume of the reference's step-4 checkpoint at
another layout.

Then what a resume refuses or passes over, on a 2-step single-rank run launched as a script
does it (``--save X --load X`` every time): the same command launched again, a checkpoint the
flags do not fit (fewer --train-iters, another --seed or data file, the other trainer), and a
checkpoint directory missing a file.
"""

from __future__ import annotations

import math
import re
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

from tests.e2e.conftest import REPO, SAMPLE, TINY_DPO, last_per_step, read_jsonl, run_cmd, run_dpo, run_dpo_until

pytestmark = pytest.mark.e2e

STEPS = 6
TP2 = ["--tensor-model-parallel-size", "2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run at TP=2: its checkpoints and its per-step records."""
    d = tmp_path_factory.mktemp("reference")
    run_dpo([*TINY_DPO, *TP2, "--train-iters", str(STEPS), "--save", str(d / "ckpt"), "--save-interval", "2",
             "--metrics-jsonl", str(d / "m.jsonl")], log=d / "log.txt").check_ok()
    records = read_jsonl(d / "m.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    return d, records


def test_sigkill_then_resume_is_bit_exact(reference, tmp_path):
    ref_dir, ref_records = reference
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    args = [*TINY_DPO, *TP2, "--train-iters", str(STEPS), "--save", str(ckpt), "--save-interval", "2",
            "--metrics-jsonl", str(metrics)]
    # SIGKILLed (agent and ranks) as soon as step index 2 (the third step) is logged: normally
    # iter_0000002 is published and step 3 is mid-flight; on a starved machine the kill may land
    # after iter_0000004, so the test follows the tracker.
    run_dpo_until(args, log=tmp_path / "killed.txt", metrics=metrics, lines=3)
    killed_steps = [r["step"] for r in read_jsonl(metrics)]
    assert killed_steps[:3] == [0, 1, 2] and killed_steps[-1] < STEPS - 1
    published = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert published in (2, 4)

    resumed = run_dpo([*args, "--load", str(ckpt)], log=tmp_path / "resumed.txt").check_ok()
    loaded = re.search(r"\[megatron-prune\] loaded (\S+) \(iteration (\d+)\)", resumed.output)
    assert loaded, resumed.output[-3000:]
    assert loaded.group(1) == str(ckpt / f"iter_{published:07d}") and int(loaded.group(2)) == published
    assert resumed.output.count("[megatron-prune] loaded") == 1  # one rank speaks

    records = read_jsonl(metrics)
    replayed = [r["step"] for r in records[len(killed_steps):]]
    assert replayed == list(range(published, STEPS))
    got = last_per_step(records)
    for ref in ref_records:
        step = ref["step"]
        for key in ("loss", "grad_norm", "margin", "chosen_reward", "rejected_reward", "scored_positions",
                    "policy_tokens", "lr"):
            assert got[step][key] == ref[key], f"step {step} {key}: resumed {got[step][key]!r} != {ref[key]!r}"
    # The killed run's own steps also matched the reference (same draws before the kill).
    for r in records[: len(killed_steps)]:
        assert r["loss"] == ref_records[r["step"]]["loss"]


@pytest.mark.slow
def test_resume_at_another_layout(reference, tmp_path):
    """The reference's TP=2 step-4 checkpoint resumed at TP=1 x DP=2: same losses within fp32."""
    ref_dir, ref_records = reference
    metrics = tmp_path / "m.jsonl"
    run = run_dpo([*TINY_DPO, "--train-iters", str(STEPS), "--load", str(ref_dir / "ckpt" / "iter_0000004"),
                   "--metrics-jsonl", str(metrics)], log=tmp_path / "log.txt").check_ok()
    assert "(iteration 4)" in run.output
    got = read_jsonl(metrics)
    assert [r["step"] for r in got] == [4, 5]
    for r in got:
        ref = ref_records[r["step"]]
        assert r["scored_positions"] == ref["scored_positions"]  # same pruning draws
        assert math.isclose(r["loss"], ref["loss"], rel_tol=1e-5, abs_tol=1e-6), (r["loss"], ref["loss"])
        assert math.isclose(r["grad_norm"], ref["grad_norm"], rel_tol=1e-4), (r["grad_norm"], ref["grad_norm"])


# --------------------------------------------------------------------------- the same command launched again

ONE_RANK = ["--model-preset", "tiny", "--device", "cpu", "--data-path", SAMPLE, "--seq-length", "128",
            "--max-prompt-length", "64", "--global-batch-size", "2", "--micro-batch-size", "2", "--lr", "1e-3"]


def _dpo(tmp_path, name: str, *args: str):
    return run_cmd([sys.executable, "-m", "megatron_prune.dpo", *ONE_RANK, *args], log=tmp_path / f"{name}.txt")


def _error(run) -> str:
    """The run's last line, which a refused resume makes its only message."""
    return run.output.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def script_run(tmp_path_factory):
    """The first launch of a script's ``--save X --load X`` (2 steps, a save after each): X does not exist yet."""
    d = tmp_path_factory.mktemp("script")
    save = d / "ckpt"
    run = _dpo(d, "first", "--train-iters", "2", "--save", str(save), "--load", str(save), "--save-interval", "1",
               "--metrics-jsonl", str(d / "m.jsonl")).check_ok()
    assert (f"[megatron-prune] --load {save} holds no complete checkpoint yet: starting a new run at iteration 0 "
            f"that saves into --save {save}") in run.output, run.output[-3000:]
    assert [r["step"] for r in read_jsonl(d / "m.jsonl")] == [0, 1]
    return save


def test_the_same_command_again_finds_the_work_done(script_run, tmp_path):
    """Relaunched after it finished: it says there is nothing to train and exits 0; without --load
    (the command of a run started without it) it refuses to overwrite the checkpoints."""
    save = script_run
    again = _dpo(tmp_path, "again", "--train-iters", "2", "--save", str(save), "--load", str(save),
                 "--metrics-jsonl", str(tmp_path / "m.jsonl")).check_ok()
    assert (f"[megatron-prune] nothing to train: the checkpoint is at iteration 2 = --train-iters 2; raise "
            "--train-iters to train further") in again.output, again.output[-3000:]
    assert not (tmp_path / "m.jsonl").exists() or read_jsonl(tmp_path / "m.jsonl") == []
    assert "differ from the checkpoint" not in again.output and "ignored:" not in again.output
    fresh = _dpo(tmp_path, "fresh", "--train-iters", "2", "--save", str(save))
    assert fresh.returncode == 2
    assert _error(fresh) == (f"megatron-prune: error: --save {save} already holds checkpoints (newest: "
                             f"{save / 'iter_0000002'}) that a new run would overwrite; pass --load {save} to resume "
                             "from it, or choose another --save")
    # Resuming another run's checkpoints into it is refused too (its checkpoints would land among these).
    other = tmp_path / "other"
    shutil.copytree(save, other)
    into = _dpo(tmp_path, "into", "--train-iters", "3", "--load", str(other), "--save", str(save))
    assert into.returncode == 2 and _error(into) == (
        f"megatron-prune: error: --save {save} already holds checkpoints (newest: {save / 'iter_0000002'}) that this "
        f"run from --load {other} would overwrite; choose another --save"), into.output[-3000:]


RESUME_REFUSALS = [
    pytest.param(["--train-iters", "1"], "the checkpoint is at iteration 2, past --train-iters 1: nothing to train; "
                 "raise --train-iters above 2 to train further", id="train-iters-below"),
    pytest.param(["--train-iters", "3", "--seed", "99"], "the checkpoint was trained with --seed 1234 and this run "
                 "has --seed 99, which would change the data order: pass --seed 1234 to resume it (or --finetune to "
                 "start a new run from its weights)", id="other-seed"),
    pytest.param(["--train-iters", "3", "--data-path", str(REPO / "megatron_prune" / "data" / "samples" /
                                                            "hh_rlhf_heldout.jsonl")],
                 "the checkpoint's run trained on 400 samples and this run's training data has 100 (another "
                 "--data-path, or other records skipped), so its data position does not apply: resume with the same "
                 "training data (or --finetune to start a new run from its weights)", id="other-data"),
    # The optimizer state itself: megatron-core would fail deep inside its loader on each of these.
    pytest.param(["--train-iters", "3", "--optimizer", "sgd"], "{ckpt}: optimizer state was saved by --optimizer adam "
                 "and this run has --optimizer sgd, whose state it cannot load; resume with --optimizer adam, or use "
                 "--finetune to start the new optimizer from the checkpoint's weights", id="other-optimizer"),
    pytest.param(["--train-iters", "3", "--bf16"], "{ckpt}: the checkpoint's run trained in fp32 (no --bf16) and this "
                 "run in bf16 (--bf16); their optimizer states differ (--bf16 keeps fp32 main weights beside the bf16 "
                 "ones): resume with no --bf16, or use --finetune to load weights only", id="other-precision"),
    pytest.param(["--train-iters", "3", "--use-distributed-optimizer"], "{ckpt}: optimizer state was saved without "
                 "--use-distributed-optimizer and cannot be loaded with --use-distributed-optimizer; drop "
                 "--use-distributed-optimizer, or use --finetune to load weights only", id="other-optimizer-format"),
]


@pytest.mark.parametrize("extra, message", RESUME_REFUSALS)
def test_resume_that_does_not_fit_the_checkpoint_is_refused(script_run, tmp_path, extra, message):
    message = message.format(ckpt=script_run / "iter_0000002")
    run = _dpo(tmp_path, "run", "--load", str(script_run), *extra)
    assert run.returncode == 2, run.output[-3000:]
    assert _error(run) == f"megatron-prune: error: --load {script_run}: {message}"
    assert "Traceback" not in run.output
    # Refused from the checkpoint's files before any rank builds a model; only the data size needs the data.
    assert "[megatron-prune] loaded" not in run.output
    assert ("[megatron-prune] megatron-prune-dpo: world" in run.output) == ("samples" in message), run.output[-3000:]
    dry = _dpo(tmp_path, "dry", "--load", str(script_run), *extra, "--dry-run")
    if "samples" in message:  # the dry run reads no data
        dry.check_ok()
    else:
        assert dry.returncode == 2 and _error(dry) == f"megatron-prune: error: --load {script_run}: {message}"
    iteration = script_run / "iter_0000002"
    if message.startswith(f"{iteration}: "):  # --load naming that checkpoint itself: its path said once
        dry = _dpo(tmp_path, "dry-iteration", "--load", str(iteration), *extra, "--dry-run")
        assert dry.returncode == 2 and _error(dry) == f"megatron-prune: error: --load {message}"


@pytest.mark.parametrize("trainer", ["dpo", "grpo"])
def test_training_data_of_another_size_is_refused_before_any_model_is_built(tmp_path, monkeypatch, capsys, trainer):
    """The data size needs the data, not the model: the trainers compare it with the checkpoint's
    as soon as they have read it, so a large model is not built and loaded only to be refused.
    (The checkpoint comes from a launch of its own: a run in this process would apply the CPU
    patches here, which later tests must not find.)"""
    from megatron_prune.training import session

    def build_nothing(*args, **kwargs):
        raise AssertionError("the run started its ranks before refusing the resume")

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    main = __import__(f"megatron_prune.{trainer}.__main__", fromlist=["main"]).main
    if trainer == "dpo":
        base = [*ONE_RANK, "--train-iters", "2", "--save", str(tmp_path / "ckpt"), "--save-interval", "1"]
        other = ["--data-path", str(REPO / "megatron_prune" / "data" / "samples" / "hh_rlhf_heldout.jsonl")]
        sizes = (400, 100)
    else:
        base = ["--model-preset", "tiny", "--device", "cpu", "--task", "toy", "--toy-num-prompts", "8",
                "--global-batch-size", "2", "--group-size", "2", "--max-new-tokens", "4", "--seq-length", "64",
                "--train-iters", "2", "--save", str(tmp_path / "ckpt"), "--save-interval", "1"]
        other = ["--toy-num-prompts", "12"]
        sizes = (8, 12)
    run_cmd([sys.executable, "-m", f"megatron_prune.{trainer}", *base], log=tmp_path / "first.txt").check_ok()
    monkeypatch.setattr(session, "start", build_nothing)
    with pytest.raises(SystemExit) as stopped:
        main([*base, "--train-iters", "3", "--load", str(tmp_path / "ckpt"), *other])
    assert stopped.value.code == 2
    assert (f"the checkpoint's run trained on {sizes[0]} samples and this run's training data has {sizes[1]}"
            in capsys.readouterr().err)


def test_training_files_of_other_content_are_warned_about_and_a_moved_copy_is_not(script_run, tmp_path):
    """The same number of pairs but other records (here the file reversed): the count check cannot
    see it, the checkpoint's record of the files' content does; a copy at another path is the same data."""
    lines = Path(SAMPLE).read_text().splitlines(keepends=True)
    (tmp_path / "reversed.jsonl").write_text("".join(reversed(lines)))
    (tmp_path / "copy.jsonl").write_text("".join(lines))
    warning = "the training data's files hold other content than the checkpoint's run read (the same 400 samples"
    other = _dpo(tmp_path, "other", "--train-iters", "3", "--load", str(script_run),
                 "--data-path", str(tmp_path / "reversed.jsonl")).check_ok()
    assert f"[megatron-prune] WARNING: --load {script_run}: {warning}" in other.output, other.output[-3000:]
    moved = _dpo(tmp_path, "moved", "--train-iters", "3", "--load", str(script_run),
                 "--data-path", str(tmp_path / "copy.jsonl")).check_ok()
    assert warning not in moved.output and "[megatron-prune] step 3/3" in moved.output, moved.output[-3000:]


def test_grpo_refuses_a_dpo_checkpoint(script_run, tmp_path):
    """The checkpoint records the trainer that wrote it; the other one refuses to resume it (even when
    the sample counts happen to agree: 400 toy prompts, 400 preference pairs)."""
    message = (f"megatron-prune: error: --load {script_run}: {script_run / 'iter_0000002'} is a DPO checkpoint; the "
               "GRPO trainer cannot resume its optimizer, schedule and data position: pass --finetune to start from "
               "its weights, or --load a GRPO checkpoint")
    for dry in ([], ["--dry-run"]):  # the checkpoint's meta.json tells, so the dry run refuses it too
        run = run_cmd([sys.executable, "-m", "megatron_prune.grpo", "--model-preset", "tiny", "--device", "cpu",
                       "--task", "toy", "--toy-num-prompts", "400", "--global-batch-size", "2", "--group-size", "2",
                       "--max-new-tokens", "4", "--seq-length", "64", "--train-iters", "3", "--load", str(script_run),
                       *dry], log=tmp_path / f"grpo{len(dry)}.txt")
        assert run.returncode == 2, run.output[-3000:]
        assert _error(run) == message


def test_checkpoint_missing_its_trainer_state_is_passed_over(script_run, tmp_path):
    """A copy that lost iter_0000002/trainer_state.pt (data position, LR schedule, RNG): the run resumes
    the newest complete checkpoint instead, saying once which one it passed over and why."""
    copy = tmp_path / "copy"
    shutil.copytree(script_run, copy)
    (copy / "iter_0000002" / "trainer_state.pt").unlink()
    run = _dpo(tmp_path, "run", "--train-iters", "2", "--load", str(copy)).check_ok()
    warning = (f"{copy / 'latest_checkpointed_iteration.txt'} names {copy / 'iter_0000002'}, which is incomplete "
               f"(missing trainer_state.pt); using {copy / 'iter_0000001'}")
    assert run.output.count(warning) == 1, run.output[-3000:]
    assert f"[megatron-prune] loaded {copy / 'iter_0000001'} (iteration 1)" in run.output
    assert "[megatron-prune] step 2/2" in run.output


def test_resume_says_which_flags_it_changes_or_ignores_and_records_the_applied_lr(script_run, tmp_path):
    """A resumed run continues the checkpoint's learning-rate schedule (Megatron's rule) and says
    which changed flags that ignores; ``lr`` in metrics.jsonl is the rate each step's update used
    (with warm-up the first update uses 0, as in Megatron)."""
    changed = ["--load", str(script_run), "--train-iters", "3", "--lr", "5e-2", "--prune-position-ratio", "0.5"]
    run = _dpo(tmp_path, "run", *changed, "--metrics-jsonl", str(tmp_path / "m.jsonl")).check_ok()
    dry = _dpo(tmp_path, "dry", *changed, "--dry-run").check_ok()  # says it before any work
    for out in (run.output, dry.output):
        assert ("resuming continues the checkpoint's learning-rate schedule; ignored: --lr 0.05 (checkpoint: 0.001)"
                in out), out[-3000:]
        # Objective flags may change on resume, but never without a word.
        assert ("resuming with flags that differ from the checkpoint's run: --prune-position-ratio 0.5 (checkpoint: "
                "1.0)" in out), out[-3000:]
    assert [r["lr"] for r in read_jsonl(tmp_path / "m.jsonl")] == [1e-3]
    _dpo(tmp_path, "warm", "--train-iters", "3", "--lr-warmup-iters", "2",
         "--metrics-jsonl", str(tmp_path / "w.jsonl")).check_ok()
    assert [r["lr"] for r in read_jsonl(tmp_path / "w.jsonl")] == pytest.approx([0.0, 5e-4, 1e-3])


def test_a_run_extended_past_its_decay_is_warned_and_override_decays_over_the_new_horizon(tmp_path):
    """A linear schedule over 2 steps, resumed to 4: Megatron's rule keeps the checkpoint's schedule,
    so steps 3 and 4 run at --min-lr 0 (said in a warning); --override-opt-param-scheduler (also in
    Megatron's spelling) decays over the 4 steps from the checkpoint's step count instead."""
    linear = ["--lr-decay-style", "linear"]
    _dpo(tmp_path, "first", *linear, "--train-iters", "2", "--save", str(tmp_path / "ckpt")).check_ok()
    kept = _dpo(tmp_path, "kept", *linear, "--train-iters", "4", "--load", str(tmp_path / "ckpt"),
                "--metrics-jsonl", str(tmp_path / "kept.jsonl")).check_ok()
    assert ("[megatron-prune] WARNING: the checkpoint's linear schedule ends at step 2, so steps 3-4 of --train-iters 4 "
            "run at learning rate 0: they train nothing; --override-opt-param-scheduler decays over --train-iters "
            "instead") in kept.output, kept.output[-3000:]
    assert "ignored: the decay horizon --train-iters 4 (checkpoint: 2)" in kept.output
    assert [r["lr"] for r in read_jsonl(tmp_path / "kept.jsonl")] == [0.0, 0.0]
    for spelling in ("--override-opt-param-scheduler", "--override-opt_param-scheduler"):
        metrics = tmp_path / f"{spelling}.jsonl"
        over = _dpo(tmp_path, spelling, *linear, "--train-iters", "4", "--load", str(tmp_path / "ckpt"), spelling,
                    "--metrics-jsonl", str(metrics)).check_ok()
        assert ("resuming with this launch's learning-rate schedule (--override-opt-param-scheduler) from step 2: "
                "the decay horizon --train-iters 4 (checkpoint: 2)") in over.output, over.output[-3000:]
        assert "[megatron-prune] WARNING" not in over.output and "ignored:" not in over.output
        assert [r["lr"] for r in read_jsonl(metrics)] == pytest.approx([5e-4, 2.5e-4])
    # A new peak and final rate apply too: the loaded param groups must not keep the checkpoint's.
    rates = _dpo(tmp_path, "rates", *linear, "--train-iters", "4", "--load", str(tmp_path / "ckpt"),
                 "--override-opt-param-scheduler", "--lr", "2e-3", "--min-lr", "1e-4",
                 "--metrics-jsonl", str(tmp_path / "rates.jsonl")).check_ok()
    assert "--lr 0.002 (checkpoint: 0.001), --min-lr 0.0001 (checkpoint: 0.0)" in rates.output, rates.output[-3000:]
    # linear from 2e-3 to 1e-4 over 4 steps, at the checkpoint's step count 2 and 3
    assert [r["lr"] for r in read_jsonl(tmp_path / "rates.jsonl")] == pytest.approx([1.05e-3, 5.75e-4])


def test_a_resume_inside_the_warm_up_keeps_its_ramp_whatever_this_launch_says(tmp_path):
    """The kept schedule includes the warm-up's starting rate, which Megatron does not save: a resume
    launched with --lr-warmup-iters 0 must still ramp from 0 as the checkpoint's run did."""
    warm = ["--lr-decay-style", "linear", "--train-iters", "6", "--lr-warmup-iters", "4"]
    _dpo(tmp_path, "whole", *warm, "--metrics-jsonl", str(tmp_path / "whole.jsonl")).check_ok()
    _dpo(tmp_path, "first", *warm, "--exit-interval", "2", "--save", str(tmp_path / "ckpt"),
         "--metrics-jsonl", str(tmp_path / "split.jsonl")).check_ok()
    _dpo(tmp_path, "rest", "--lr-decay-style", "linear", "--train-iters", "6", "--lr-warmup-iters", "0",
         "--load", str(tmp_path / "ckpt"), "--metrics-jsonl", str(tmp_path / "split.jsonl")).check_ok()
    whole = [r["lr"] for r in read_jsonl(tmp_path / "whole.jsonl")]
    assert whole == pytest.approx([0.0, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 5e-4])
    assert [r["lr"] for r in read_jsonl(tmp_path / "split.jsonl")] == whole


GROUPS_AFTER_RESUME = textwrap.dedent(
    """
    import sys
    from megatron_prune.training import loop

    real_resume = loop.resume

    def resume(parts, objective, ckpt, **kwargs):
        start = real_resume(parts, objective, ckpt, **kwargs)
        for inner in getattr(parts.optimizer, "chained_optimizers", [parts.optimizer]):
            for group in inner.optimizer.param_groups:
                print("PARAM GROUP", tuple(group["betas"]), group["eps"], flush=True)
        return start

    loop.resume = resume
    if __name__ == "__main__":  # not in the process the save spawns (it imports this script again)
        from megatron_prune.dpo.__main__ import main
        sys.exit(main(sys.argv[1:]))
    """
)


def test_changed_adam_flags_apply_after_the_optimizer_state_is_loaded(script_run, tmp_path):
    """Loading the optimizer restores the checkpoint's betas and epsilon with its state; a resume
    that changes them (and says so) trains with the new values, as it says."""
    script = tmp_path / "groups_after_resume.py"
    script.write_text(GROUPS_AFTER_RESUME)
    run = run_cmd([sys.executable, str(script), *ONE_RANK, "--load", str(script_run), "--train-iters", "3",
                   "--adam-beta2", "0.5", "--adam-eps", "1e-4"], log=tmp_path / "run.txt").check_ok()
    assert ("resuming with flags that differ from the checkpoint's run: --adam-beta2 0.5 (checkpoint: 0.95), "
            "--adam-eps 0.0001 (checkpoint: 1e-08)") in run.output, run.output[-3000:]
    groups = re.findall(r"PARAM GROUP (.*)", run.output)
    assert groups and set(groups) == {"(0.9, 0.5) 0.0001"}, run.output[-3000:]


@pytest.mark.parametrize("damaged", ["trainer_state.pt", "meta.json"])
def test_damaged_checkpoint_file_is_named_with_the_way_out(script_run, tmp_path, damaged):
    """A checkpoint file cut short (a failed copy, a full disk) stops the resume in one line that
    names the file and the earlier checkpoints of the same run."""
    copy = tmp_path / "ckpt"
    shutil.copytree(script_run, copy)
    target = copy / "iter_0000002" / damaged
    target.write_bytes(target.read_bytes()[:40])
    run = _dpo(tmp_path, "run", "--load", str(copy), "--train-iters", "3")
    assert run.returncode == 2, run.output[-3000:]
    assert "Traceback" not in run.output
    assert _error(run).startswith(f"megatron-prune: error: {target} cannot be read"), _error(run)
    assert f"--load an earlier checkpoint directory of the same run ({copy}/iter_*)" in _error(run)
