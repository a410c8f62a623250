"""Bad flags and layouts end in one clear message naming the flag, exit code 2, before any rank
does work (no process group is started).

Most cases call the CLI's ``main`` in-process with torchrun's ``WORLD_SIZE`` faked: validation
happens before ``torch.distributed`` starts, so this is exactly what each rank would do. One case
is a real 2-rank torchrun launch, to show only rank 0 speaks.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from megatron_prune.model.arch import get_preset
from tests.e2e.conftest import REPO, SAMPLE, TINY_DPO, launch_env, torchrun_cmd

pytestmark = pytest.mark.e2e


def _main(argv, monkeypatch, capsys, *, world=1):
    from megatron_prune.dpo.__main__ import main

    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.chdir(REPO)  # relative paths in the cases (README.md, .) are the repository's
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    return exc.value.code, err


def _no_process_group():
    import torch.distributed as dist

    return not dist.is_initialized()


def _fake_checkpoint(root, iteration: int, arch) -> None:
    """A save directory with one checkpoint: its meta.json and empty stand-ins for the other files a save writes."""
    ckpt = root / f"iter_{iteration:07d}"
    (ckpt / "dist").mkdir(parents=True)
    (ckpt / "dist" / ".metadata").write_bytes(b"")
    (ckpt / "trainer_state.pt").write_bytes(b"")
    (ckpt / "meta.json").write_text(json.dumps(
        {"format": "megatron-prune/1", "iteration": iteration, "arch": arch.to_dict(), "has_optimizer": True}))


BAD = [
    pytest.param(["--prune-position-ratio", "0"], 1, "--prune-position-ratio must be in (0, 1], got 0.0", id="alpha=0"),
    pytest.param(["--prune-position-ratio", "1.5"], 1, "--prune-position-ratio", id="alpha>1"),
    pytest.param(["--prune-seq-min-ratio", "0"], 1, "--prune-seq-min-ratio must be in (0, 1]", id="rho_min=0"),
    pytest.param(["--prune-seq-min-ratio", "1.01"], 1, "--prune-seq-min-ratio", id="rho_min>1"),
    pytest.param(["--prune-branch-chosen-prob", "0"], 1, "--prune-branch-chosen-prob must be in (0, 1)", id="q=0"),
    pytest.param(["--prune-branch-chosen-prob", "1"], 1, "--prune-branch-chosen-prob", id="q=1"),
    pytest.param(["--tensor-model-parallel-size", "2"], 3,
                 "world size 3 is not divisible by tensor-model-parallel-size", id="world%tp"),
    pytest.param(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 6,
                 "pipeline-model-parallel-size = 2 x 2", id="world%tpxpp"),
    pytest.param(["--global-batch-size", "6"], 2,
                 "--global-batch-size 6 is not divisible by --micro-batch-size 2 x data-parallel size 2", id="gbs%mbxdp"),
    pytest.param(["--sequence-parallel"], 2, "--sequence-parallel needs --tensor-model-parallel-size > 1", id="sp-without-tp"),
    pytest.param(["--virtual-pipeline-model-parallel-size", "2"], 1, "--virtual-pipeline-model-parallel-size 2 needs a "
                 "value >= 2 and --pipeline-model-parallel-size > 1 (it is 1)", id="vpp-without-pp"),
    pytest.param(["--lr", "1e-6", "--min-lr", "1e-3"], 1, "--min-lr 0.001 must be <= --lr 1e-06", id="min-lr>lr"),
    pytest.param(["--lr", "-1e-5"], 1, "--lr and --min-lr must be >= 0", id="negative-lr-exponent"),
    pytest.param(["--seed", str(2**64)], 1, f"--seed must be in [-2**62, 2**62), got {2**64}", id="seed-overflow"),
    pytest.param(["--seq-length", "2048"], 1, "--seq-length 2048 is longer than the model's context "
                 "(max_position_embeddings 1024)", id="seq-length>context"),
    pytest.param(["--optimizer", "sgd", "--use-distributed-optimizer"], 2, "--use-distributed-optimizer needs "
                 "--optimizer adam (Megatron's distributed optimizer supports Adam only), got --optimizer sgd",
                 id="sgd-distopt"),
    pytest.param(["--adam-beta1", "2"], 1, "--adam-beta1 must be in [0, 1), got 2.0", id="beta1"),
    pytest.param(["--weight-decay", "-0.1"], 1, "--weight-decay must be >= 0, got -0.1", id="weight-decay"),
    pytest.param(["--log-interval", "0"], 1, "--log-interval must be >= 1, got 0", id="log-interval"),
    pytest.param(["--distributed-timeout-minutes", "0"], 1, "--distributed-timeout-minutes must be > 0", id="timeout"),
    pytest.param(["--max-prompt-length", "128"], 1, "--max-prompt-length must be in [1, --seq-length 128), got 128",
                 id="prompt-fills-the-sequence"),
    pytest.param(["--dpo-beta", "inf"], 1, "argument --dpo-beta: expected a finite number, got 'inf'", id="beta-inf"),
    pytest.param(["--lr", "nan"], 1, "argument --lr: expected a finite number, got 'nan'", id="lr-nan"),
    pytest.param(["--lr", "1e-3x"], 1, "argument --lr: expected a number, got '1e-3x'", id="lr-not-a-number"),
    pytest.param(["--eval-interval", "2"], 1, "--eval-interval needs --eval-data-path", id="eval-interval-alone"),
    pytest.param(["--finetune"], 1, "--finetune needs --load", id="finetune-alone"),
    pytest.param(["--ref-cache", "cache"], 1, "--ref-cache needs --ref-mode precomputed", id="ref-cache-alone"),
    pytest.param(["--lora-alpha", "16"], 1, "--lora-alpha needs --lora-rank > 0 (LoRA is off at rank 0)", id="alpha-alone"),
    pytest.param(["--metrics-jsonl", "."], 1, "--metrics-jsonl .: is a directory", id="metrics-is-a-dir"),
    pytest.param(["--save", "README.md"], 1, "--save README.md: exists and is not a directory", id="save-is-a-file"),
    pytest.param(["--ref-load", "no-such-ckpt"], 1, "--ref-load no-such-ckpt: directory does not exist",
                 id="ref-load-missing"),
    pytest.param(["--load", "no-such-ckpt", "--save", "other-dir"], 1, "--load no-such-ckpt: directory does not exist",
                 id="load-missing"),
    pytest.param(["--recompute-activations", "--recompute-granularity", "selective"], 1,
                 "give one of --recompute-activations (full recompute of every layer) and --recompute-granularity, "
                 "not both", id="recompute-twice"),
    pytest.param(["--recompute-method", "block"], 1, "--recompute-method needs --recompute-granularity full",
                 id="recompute-method-alone"),
    pytest.param(["--recompute-granularity", "selective", "--recompute-num-layers", "2"], 1,
                 "--recompute-num-layers needs --recompute-granularity full", id="recompute-layers-selective"),
    pytest.param(["--recompute-granularity", "full", "--recompute-modules", "mlp"], 1,
                 "--recompute-modules needs --recompute-granularity selective", id="recompute-modules-full"),
    pytest.param(["--recompute-granularity", "full", "--recompute-num-layers", "0"], 1,
                 "--recompute-num-layers must be >= 1, got 0", id="recompute-layers=0"),
    pytest.param(["--recompute-granularity", "full", "--recompute-num-layers", "3"], 1,
                 "--recompute-num-layers 3 does not divide the model's 4 layers into chunks (--recompute-method "
                 "uniform); use a divisor, or --recompute-method block", id="recompute-layers%layers"),
    pytest.param(["--pipeline-model-parallel-size", "2", "--recompute-granularity", "full", "--recompute-num-layers",
                  "4"], 2, "--recompute-num-layers 4 does not divide the 2 layers of each pipeline stage",
                 id="recompute-layers%stage"),
    pytest.param(["--expert-model-parallel-size", "0"], 2, "--expert-model-parallel-size must be >= 1, got 0",
                 id="ep=0"),
    pytest.param(["--expert-model-parallel-size", "2", "--global-batch-size", "4"], 2,
                 "--expert-model-parallel-size 2 needs a mixture-of-experts model; qwen3 is dense", id="ep-on-dense"),
    # The layout against the architecture (tiny: 4 heads, 2 key-value heads, 4 layers).
    pytest.param(["--tensor-model-parallel-size", "3"], 3,
                 "--tensor-model-parallel-size 3 does not divide the model's 4 attention heads", id="heads%tp"),
    pytest.param(["--pipeline-model-parallel-size", "8"], 8,
                 "--pipeline-model-parallel-size 8 does not divide the model's 4 layers into equal stages", id="layers%pp"),
    pytest.param(["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "4"], 2,
                 "--pipeline-model-parallel-size 2 x --virtual-pipeline-model-parallel-size 4 does not divide the "
                 "model's 4 layers", id="layers%ppxvpp"),
    pytest.param(["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
                  "--global-batch-size", "2"], 2,
                 "--virtual-pipeline-model-parallel-size 2 needs a multiple of --pipeline-model-parallel-size 2 "
                 "microbatches per step; --global-batch-size 2 / (--micro-batch-size 2 x data-parallel size 1) "
                 "gives 1", id="vpp-too-few-microbatches"),
    pytest.param(["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
                  "--global-batch-size", "6"], 2,
                 "--virtual-pipeline-model-parallel-size 2 needs a multiple of --pipeline-model-parallel-size 2 "
                 "microbatches per step; --global-batch-size 6 / (--micro-batch-size 2 x data-parallel size 1) "
                 "gives 3", id="vpp-odd-microbatches"),
    pytest.param(["--model-preset", "tiny-moe", "--tensor-model-parallel-size", "2"], 2,
                 "a mixture-of-experts model at --tensor-model-parallel-size > 1 needs --sequence-parallel",
                 id="moe-tp-without-sp"),
    # Outputs that cannot be written: probed by writing, not by permission bits (root passes those).
    pytest.param(["--save", "/proc/megatron-prune-save"], 1,
                 "--save /proc/megatron-prune-save: cannot write into /proc", id="save-unwritable",
                 marks=pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")),
    pytest.param(["--tensorboard-dir", "tb"], 1, "--tensorboard-dir tb needs the tensorboard package", id="no-tensorboard",
                 marks=pytest.mark.skipif(__import__("importlib").util.find_spec("tensorboard") is not None,
                                          reason="tensorboard is installed here")),
    pytest.param(["--ref-mode", "precomputed", "--ref-cache", "/proc/megatron-prune-cache"], 1,
                 "--ref-cache /proc/megatron-prune-cache: cannot write into /proc", id="ref-cache-unwritable",
                 marks=pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")),
    pytest.param(["--ref-mode", "precomputed", "--save", "/proc/megatron-prune-save"], 1,
                 "--ref-cache (default: ref_logps under --save, else beside --data-path) "
                 "/proc/megatron-prune-save/ref_logps: cannot write into /proc", id="ref-cache-default-unwritable",
                 marks=pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")),
    pytest.param(["--metrics-jsonl", "/proc/megatron-prune/m.jsonl"], 1,
                 "--metrics-jsonl /proc/megatron-prune/m.jsonl: cannot write into /proc", id="metrics-unwritable",
                 marks=pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")),
]


@pytest.mark.parametrize("extra, world, message", BAD)
def test_bad_flag_rejected_before_any_work(extra, world, message, monkeypatch, capsys):
    code, err = _main([*TINY_DPO, *extra], monkeypatch, capsys, world=world)
    assert code == 2
    assert message in err, err
    assert "Traceback" not in err
    assert _no_process_group()


def test_a_sequence_of_one_token_is_refused_before_any_work(monkeypatch, capsys):
    i = TINY_DPO.index("--max-prompt-length")
    argv = [*TINY_DPO[:i], *TINY_DPO[i + 2:], "--seq-length", "1"]
    code, err = _main(argv, monkeypatch, capsys, world=1)
    assert code == 2 and "--seq-length 1 leaves no room for a pair" in err and "Traceback" not in err, err


def test_a_layout_checked_outside_torchrun_says_how_to_launch(monkeypatch, capsys):
    """Without torchrun the world is one rank: a TP=2 layout (even in a dry run) is refused with the
    way to launch it or to check it, not only with the arithmetic."""
    from megatron_prune.dpo.__main__ import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exc:
        main([*TINY_DPO, "--tensor-model-parallel-size", "2", "--dry-run"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert "world size 1 is not divisible" in err and "torchrun --nproc-per-node N" in err, err
    assert "set WORLD_SIZE=N to check a layout with --dry-run" in err, err


def test_valid_flags_pass_validation(monkeypatch, capsys):
    """The checks are not too strict: TP=2 x DP=2 with the same batch passes (dry run)."""
    from megatron_prune.dpo.__main__ import main

    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main([*TINY_DPO, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--dry-run"]) == 0
    assert "data-parallel 2" in capsys.readouterr().out
    assert _no_process_group()


@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry-run"])
def test_checkpoint_of_another_architecture_rejected(tmp_path, monkeypatch, capsys, dry_run):
    other = get_preset("tiny-tied")
    assert other != get_preset("tiny")
    _fake_checkpoint(tmp_path / "ckpt", 2, other)
    code, err = _main([*TINY_DPO, "--load", str(tmp_path / "ckpt"), *(["--dry-run"] if dry_run else [])],
                      monkeypatch, capsys)
    assert code == 2
    assert f"--load {tmp_path / 'ckpt'} holds a different architecture" in err, err
    assert "tie_word_embeddings True (not False)" in err, err  # what differs, not only the shared summary
    assert "Traceback" not in err
    assert _no_process_group()
    # The same checkpoint as the reference: named by --ref-load (it was refused only after the ranks
    # had built the models, with a hint to drop --model-preset).
    code, err = _main([*TINY_DPO, "--ref-load", str(tmp_path / "ckpt"), *(["--dry-run"] if dry_run else [])],
                      monkeypatch, capsys)
    assert code == 2
    assert (f"--ref-load {tmp_path / 'ckpt'}: {tmp_path / 'ckpt' / 'iter_0000002'} holds another architecture "
            "(tie_word_embeddings True (not False)) than the policy; the reference must be the same model") in err, err
    assert _no_process_group()


@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry-run"])
def test_save_holding_checkpoints_without_load_is_refused(tmp_path, monkeypatch, capsys, dry_run):
    """Rerunning a run's command without --load would start at iteration 0 and overwrite its checkpoints."""
    save = tmp_path / "ckpt"
    _fake_checkpoint(save, 2, get_preset("tiny"))
    _fake_checkpoint(save, 4, get_preset("tiny"))
    code, err = _main([*TINY_DPO, "--save", str(save), *(["--dry-run"] if dry_run else [])], monkeypatch, capsys)
    assert code == 2
    assert err.strip().splitlines() == [
        f"megatron-prune: error: --save {save} already holds checkpoints (newest: {save / 'iter_0000004'}) that a new "
        f"run would overwrite; pass --load {save} to resume from it, or choose another --save"]
    assert _no_process_group()


@pytest.mark.parametrize("load", ["folder", "iteration"])
@pytest.mark.parametrize("start", ["finetune", "lora"])
def test_a_new_run_from_a_checkpoint_into_its_own_folder_is_refused(tmp_path, monkeypatch, capsys, start, load):
    """--finetune, or LoRA from a full-parameter checkpoint, starts a new run at iteration 0 from
    --load's weights: saving into that run's folder replaced its checkpoints of the same
    iterations (the new run's own base and reference among them). Refused, also in a dry run,
    whether --load names the folder or one checkpoint in it (X/iter_N)."""
    save = tmp_path / "ckpt"
    _fake_checkpoint(save, 2, get_preset("tiny"))
    source = save if load == "folder" else save / "iter_0000002"
    flags = ["--finetune"] if start == "finetune" else ["--lora-rank", "4"]
    argv = [*TINY_DPO[2:], *flags, "--save", str(save), "--load", str(source), "--dry-run"]
    code, err = _main(argv, monkeypatch, capsys)
    how = "--finetune" if start == "finetune" else "LoRA starting from its model weights"
    assert code == 2
    assert err.strip().splitlines() == [
        f"megatron-prune: error: --load {source}: {how} starts a new run at iteration 0 from it, and --save {save} is "
        "that run's folder: the new checkpoints would replace its checkpoints of the same iterations (the new run's "
        "base and reference among them); choose another --save"]
    assert _no_process_group()


def test_save_and_load_of_a_new_directory_start_a_new_run(tmp_path, monkeypatch, capsys):
    """A launch script passes --save X --load X every time: on the first launch X holds nothing yet
    (here only a first save that was killed), so the run starts fresh and says so; without a
    model of its own there is nothing to start from."""
    from megatron_prune.dpo.__main__ import main

    save = tmp_path / "ckpt"
    (save / "iter_0000002.tmp" / "dist").mkdir(parents=True)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert main([*TINY_DPO, "--save", str(save), "--load", str(save), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("holds no complete checkpoint yet") == 1
    assert (f"[megatron-prune] --load {save} holds no complete checkpoint yet; found only iter_0000002.tmp (a save "
            f"that did not finish): starting a new run at iteration 0 that saves into --save {save}") in out, out
    code, err = _main([*TINY_DPO[2:], "--save", str(save), "--load", str(save), "--dry-run"], monkeypatch, capsys)
    assert code == 2
    assert err.strip().splitlines() == [
        f"megatron-prune: error: --load {save}: no complete checkpoint found (expected iter_*/ holding meta.json, "
        "trainer_state.pt, dist/.metadata); found only iter_0000002.tmp (a save that did not finish); a first run "
        f"into --save {save} needs --model-preset or --hf-model to start from"]
    assert _no_process_group()


DRY_RUN_REFUSES = [
    pytest.param(["--model-preset", "tiny"], "--data-path is required", id="no-data"),
    pytest.param(["--model-preset", "tiny", "--data-path", "missing.jsonl"],
                 "--data-path missing.jsonl: data file not found", id="missing-data"),
    pytest.param([*TINY_DPO, "--eval-data-path", "missing.jsonl"],
                 "--eval-data-path missing.jsonl: data file not found", id="missing-eval-data"),
    pytest.param([*TINY_DPO, "--eval-data-path", "."], "--eval-data-path .: is a directory", id="directory-data"),
    pytest.param([*TINY_DPO, "--tokenizer", "README.md"], "README.md: not a SentencePiece model", id="bad-tokenizer"),
    pytest.param([*TINY_DPO, "--dpo-layout", "shared", "--no-selective-head"],
                 "--dpo-layout shared needs the selective head", id="shared-without-selective-head"),
    pytest.param([*TINY_DPO, "--ref-mode", "adapter-off"], "--ref-mode adapter-off needs LoRA adapters",
                 id="adapter-off-without-lora"),
]


@pytest.mark.parametrize("argv, message", DRY_RUN_REFUSES)
def test_dry_run_refuses_what_the_run_would(argv, message, monkeypatch, capsys):
    """--dry-run runs every check that needs no rank and no data, so it refuses what the real run
    would refuse at its start, with the same one-line message."""
    code, err = _main([*argv, "--dry-run"], monkeypatch, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"megatron-prune: error: {message}"), err
    assert _no_process_group()


def test_grpo_dry_run_checks_its_data_and_checkpoint(tmp_path, monkeypatch, capsys):
    from megatron_prune.grpo.__main__ import main

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    _fake_checkpoint(tmp_path / "ckpt", 1, get_preset("tiny-tied"))
    cases = [(["--task", "gsm8k", "--data-path", "missing.jsonl"], "--data-path missing.jsonl: data file not found"),
             (["--task", "toy", "--load", str(tmp_path / "ckpt")], "holds a different architecture"),
             (["--task", "toy", "--group-size", "1"], "--group-size must be >= 2, got 1"),
             (["--task", "toy", "--group-size", "0"], "--group-size must be >= 2, got 0"),
             (["--task", "toy", "--dppo-prompt-floor", "1.5"],
              "--dppo-prompt-floor must be in (0, 1] (a keep probability), got 1.5"),
             (["--task", "toy", "--dppo-completion-floor", "0"], "--dppo-completion-floor must be in (0, 1] (a keep "
              "probability above 0: a zero floor makes the estimator biased), got 0.0"),
             (["--task", "toy", "--toy-num-prompts", "4", "--global-batch-size", "8"],
              "--global-batch-size 8 asks for 8 different prompts a step (one group of --group-size completions "
              "each), but --toy-num-prompts is 4: lower --global-batch-size to at most 4"),
             (["--task", "toy", "--toy-num-digits", "11"], "--toy-num-digits must be in [2, 10], got 11"),
             (["--task", "toy", "--toy-prompt-length", "2"], "--toy-prompt-length must be >= 3"),
             (["--task", "toy", "--clip-eps-low", "1.0"], "--clip-eps-low must be in [0, 1), got 1.0"),
             (["--task", "toy", "--temperature", "nan"], "argument --temperature: expected a finite number, got 'nan'"),
             (["--task", "toy", "--temperature", "1e-40"], "--temperature 1e-40 is below 0.0001, where the scaled "
              "logits overflow; use --temperature 0 for greedy sampling"),
             (["--task", "toy", "--kl-beta", "inf"], "argument --kl-beta: expected a finite number, got 'inf'"),
             (["--task", "toy", "--data-path", SAMPLE], "--data-path is for --task gsm8k or math"),
             (["--task", "toy", "--dppo-completion-prune-rate", "0.8"],
              "--dppo-completion-prune-rate 0.8 cannot be reached with --dppo-completion-floor 0.3"),
             (["--task", "toy", "--dppo-prompt-prune-rate", "0.5", "--dppo-prompt-floor", "0.6"],
              "at most 1 - floor = 0.4 can be pruned (lower --dppo-prompt-floor to prune more)")]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exc:
            main(["--model-preset", "tiny", *argv, "--dry-run"])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and message in err, err
    # GRPO's global batch counts prompts and a microbatch holds completion rows: 4 prompts of 16
    # completions run as rows of 16, which the pairs-per-microbatch rule of DPO would refuse.
    assert main(["--model-preset", "tiny", "--task", "toy", "--global-batch-size", "4", "--group-size", "16",
                 "--micro-batch-size", "16", "--dry-run"]) == 0
    monkeypatch.setenv("WORLD_SIZE", "2")  # the interleaved schedule is accepted (its passes get placeholders)
    assert main(["--model-preset", "tiny", "--task", "toy", "--pipeline-model-parallel-size", "2",
                 "--virtual-pipeline-model-parallel-size", "2", "--global-batch-size", "8", "--dry-run"]) == 0
    with pytest.raises(SystemExit):
        main(["--model-preset", "tiny", "--task", "toy", "--global-batch-size", "3", "--dry-run"])
    assert "--global-batch-size 3 is not divisible by the data-parallel size 2" in capsys.readouterr().err
    assert _no_process_group()


def test_two_ranks_message_is_the_last_line(tmp_path):
    """A real torchrun launch: both ranks exit 2 before starting the process group; rank 0's one-line
    message is also the root cause in torchrun's failure report, and it is repeated after that
    report, so it is the last thing the user reads."""
    cmd = torchrun_cmd(["-m", "megatron_prune.dpo", *TINY_DPO, "--tensor-model-parallel-size", "2",
                        "--pipeline-model-parallel-size", "2"])
    # One pipe for both streams; it closes only when the repeater has written (after torchrun exited).
    proc = subprocess.run(cmd, cwd=REPO, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=240)
    out = proc.stdout
    assert proc.returncode != 0
    message = ("megatron-prune: error: world size 2 is not divisible by tensor-model-parallel-size x "
               "pipeline-model-parallel-size = 2 x 2")
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines[-1].startswith(message), out[-4000:]
    assert "(exitcode: 2)" in out or "exitcode  : 2" in out, out[-4000:]
    assert f"traceback : {lines[-1]}" in out, out[-4000:]  # the report's root cause is our message
    # No rank printed a traceback (torchrun's own ChildFailedError summary is expected).
    assert "[rank0]:" not in out and "[rank1]:" not in out, out[-4000:]
    assert "megatron_prune/" not in out and "[megatron-prune] step" not in out


def test_runtime_failure_is_the_root_cause_in_torchrun_report(tmp_path):
    """An unexpected exception inside the run (here raised by a stand-in for the trainer, set up by
    the launched script itself) is what torchrun's "Root Cause" entry shows: its type, message and
    traceback, not only a pointer to the elastic docs."""
    script = tmp_path / "broken_run.py"
    script.write_text(
        "import sys\n"
        "import megatron_prune.dpo.trainer as trainer\n"
        "def run_dpo(configs, checked=None):\n"
        "    raise RuntimeError('the stand-in trainer failed')\n"
        "trainer.run_dpo = run_dpo\n"
        "from megatron_prune.dpo.__main__ import main\n"
        "sys.exit(main())\n")
    proc = subprocess.run(torchrun_cmd([str(script), *TINY_DPO]), cwd=REPO, env=launch_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=240)
    out = proc.stdout
    assert proc.returncode != 0
    report = out[out.index("Root Cause"):]
    assert "RuntimeError: the stand-in trainer failed" in report, out[-4000:]
    assert "broken_run.py" in report and "To enable traceback" not in report.split("Other Failures")[0], report


def test_unknown_model_preset_fails_validation_in_one_line(monkeypatch, capsys):
    """--model-preset big stops at validation, also under --dry-run: one line, no traceback, no usage dump."""
    code, err = _main([*TINY_DPO[2:], "--model-preset", "big", "--dry-run"], monkeypatch, capsys)
    assert code == 2
    assert err.strip().splitlines() == [
        "megatron-prune-dpo: error: argument --model-preset: invalid choice: 'big' (choose from 'tiny', 'tiny-tied', 'tiny-moe') "
        "(run with --help to see every flag, its choices and default)"]


def _gzip_cut(path):
    import gzip

    data = gzip.compress(open(SAMPLE, "rb").read(), mtime=0)
    path.write_bytes(data[: len(data) // 2])
    return path


RUN_REFUSES = [
    pytest.param(lambda tmp: ["--tokenizer", SAMPLE], f"{SAMPLE}: not a SentencePiece model (", id="tokenizer-not-a-model"),
    pytest.param(lambda tmp: ["--tokenizer", str(tmp)], f"{{tmp}}: not a Hugging Face tokenizer directory: it holds none",
                 id="tokenizer-empty-dir"),
    pytest.param(lambda tmp: ["--data-path", str(_gzip_cut(tmp / "cut.jsonl.gz"))],
                 "{tmp}/cut.jsonl.gz: unreadable gzip: Compressed file ended before the end-of-stream marker was "
                 "reached", id="truncated-gzip"),
    pytest.param(lambda tmp: ["--data-path", str(tmp)], "--data-path {tmp}: is a directory: expected a data file", id="directory"),
]


@pytest.mark.parametrize("extra, message", RUN_REFUSES)
def test_unusable_tokenizer_or_data_file_stops_the_run_in_one_line(extra, message, tmp_path, monkeypatch, capsys):
    """A --tokenizer or data file that exists but cannot be used stops the run before any rank
    works: one line naming the path and what was expected, exit code 2, no traceback."""
    argv = extra(tmp_path)
    base = TINY_DPO
    if "--data-path" in argv:  # in place of the base's, not after it (which a warning would name)
        at = base.index("--data-path")
        base = base[:at] + base[at + 2:]
    code, err = _main([*base, *argv], monkeypatch, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"megatron-prune: error: {message.format(tmp=tmp_path)}"), err
    assert "--skip-invalid-records" not in err  # skipping records would not help
    assert _no_process_group()


@pytest.mark.parametrize("flags, message", [
    (["--device", "gpu"], "argument --device: invalid choice: 'gpu' (choose from 'auto', 'cuda', 'npu', 'cpu')"),
    (["--device"], "argument --device: expected one argument"),
], ids=["unknown", "no-value"])
def test_bad_device_is_one_usage_error_of_the_trainer(flags, message, monkeypatch, capsys):
    """A mistyped --device is the trainer parser's usage error (exit 2, its program name), not a
    traceback from the device bootstrap, nor an error of an internal parser."""
    code, err = _main([*TINY_DPO, *flags], monkeypatch, capsys)
    assert code == 2 and f"megatron-prune-dpo: error: {message}" in err, err
    assert "Traceback" not in err and "__main__.py" not in err


def test_help_needs_no_device(monkeypatch, capsys):
    """--help prints on a machine without the device --device names (no GPU here)."""
    from megatron_prune.dpo.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["--device", "cuda", "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and "--prune-branch" in out


def test_a_model_directory_without_a_tokenizer_is_told_to_pass_one(tmp_path, monkeypatch, capsys):
    """--hf-model of a directory that holds weights but no tokenizer files: the error says to name one."""
    from tests.unit.model.hf_models import make_hf_model

    hf = make_hf_model("qwen3", str(tmp_path / "hf"), assets=False)
    code, err = _main([*TINY_DPO[2:], "--hf-model", hf, "--dry-run"], monkeypatch, capsys)
    assert code == 2 and f"megatron-prune: error: {hf}: not a Hugging Face tokenizer directory" in err, err
    assert err.rstrip().endswith("(no --tokenizer was given, so the run looked there; pass --tokenizer DIR)"), err


def test_dry_run_prints_the_values_the_run_resolves(monkeypatch, capsys):
    """Flags left out whose value the run decides are printed as it will run them (the configs
    above show them unset: ref_mode=None, alpha=None)."""
    from megatron_prune.dpo.__main__ import main

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert main([*TINY_DPO, "--lora-rank", "4", "--dry-run"]) == 0
    assert "  resolved: --ref-mode adapter-off, --lora-alpha 4 (scale 1)\n" in capsys.readouterr().out
    assert main([*TINY_DPO, "--dry-run"]) == 0
    assert "  resolved: --ref-mode online\n" in capsys.readouterr().out


@pytest.mark.parametrize("world", ["8x", "0"])
def test_a_malformed_world_size_is_one_line(world, monkeypatch, capsys):
    code, err = _main([*TINY_DPO, "--dry-run"], monkeypatch, capsys, world=world)
    assert code == 2 and err.strip() == (f"megatron-prune: error: WORLD_SIZE='{world}' is not a positive integer "
                                         "(torchrun sets it; unset it to run one process)"), err


def test_an_hf_model_that_is_a_file_is_named(monkeypatch, capsys):
    """--hf-model names the trainer's own flag when it is given a file (not the converter's --hf-dir)."""
    i = TINY_DPO.index("--model-preset")
    code, err = _main([*TINY_DPO[:i], *TINY_DPO[i + 2:], "--hf-model", "README.md", "--dry-run"], monkeypatch, capsys,
                      world=1)
    assert code == 2 and err.strip().splitlines()[-1] == "megatron-prune: error: --hf-model README.md: not a directory", err


@pytest.mark.parametrize("cli", ["dpo", "grpo"])
def test_a_list_flag_given_twice_is_said(cli, monkeypatch, capsys):
    """argparse keeps the last of a repeated flag (so a script's trailing "$@" overrides its own
    flags): ``--data-path a.jsonl --data-path b.jsonl`` trains on b alone, which was silent. The
    replaced list is now said in one warning line from rank 0; one flag with both values reads both."""
    main = __import__(f"megatron_prune.{cli}.__main__", fromlist=["main"]).main
    monkeypatch.chdir(REPO)
    samples = REPO / "megatron_prune" / "data" / "samples"
    first, second = ((SAMPLE, str(samples / "hh_rlhf_heldout.jsonl")) if cli == "dpo" else
                     (str(samples / "gsm8k_sample.jsonl"), str(samples / "gsm8k_sample.jsonl")))
    task = [] if cli == "dpo" else ["--task", "gsm8k"]
    assert main(["--model-preset", "tiny", *task, "--data-path", first, "--data-path", second, "--dry-run"]) in (0, None)
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"megatron-prune: warning: --data-path given twice: its values {second} replace the earlier "
                     f"{first}; give every value after one --data-path to use them all"], lines
    monkeypatch.setenv("RANK", "1")
    assert main(["--model-preset", "tiny", *task, "--data-path", first, "--data-path", second, "--dry-run"]) in (0, None)
    assert "warning" not in capsys.readouterr().err
    monkeypatch.setenv("RANK", "0")
    assert main(["--model-preset", "tiny", *task, "--data-path", first, second, "--dry-run"]) in (0, None)
    assert "warning" not in capsys.readouterr().err
