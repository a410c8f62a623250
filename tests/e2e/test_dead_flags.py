"""A flag given on the command line that the rest of the run ignores gets one warning line from rank 0
before any rank works (also under --dry-run), and the run goes on; a flag that contradicts another one
is a usage error (exit code 2, one line). Defaults, presets and the commands of the README and the
example scripts print no warning.

Every case calls the CLI's ``main`` in-process with ``--dry-run`` (the warnings come before the dry run
returns, so this is what every launch prints first).
"""

from __future__ import annotations

import json
import shlex
import subprocess

import pytest
import torch

from megatron_prune.model.arch import get_preset
from tests.e2e.conftest import REPO, SAMPLE, TINY_DPO

pytestmark = pytest.mark.e2e

GSM8K = str(REPO / "megatron_prune" / "data" / "samples" / "gsm8k_sample.jsonl")
HELDOUT = str(REPO / "megatron_prune" / "data" / "samples" / "hh_rlhf_heldout.jsonl")
DPO = ["--model-preset", "tiny", "--data-path", SAMPLE, "--seq-length", "128", "--global-batch-size", "8",
       "--micro-batch-size", "2", "--lr", "1e-3"]
TINY_GRPO = ["--model-preset", "tiny", "--device", "cpu", "--task", "toy"]
WARNING = "megatron-prune: warning: "


def _dry_run(cli: str, argv: list[str], monkeypatch, capsys, *, world: int = 1, rank: int = 0):
    """(exit code, stderr lines) of ``cli``'s main over ``argv`` with --dry-run."""
    main = __import__(f"megatron_prune.{cli}.__main__", fromlist=["main"]).main
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.chdir(REPO)
    try:
        code = main([*argv, "--dry-run"])
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err.strip().splitlines()


def _checkpoint(root, *, has_optimizer: bool = True, optimizer_format: str | None = None) -> str:
    """A save directory holding one checkpoint of the tiny preset (meta.json and empty stand-ins)."""
    ckpt = root / "iter_0000002"
    (ckpt / "dist").mkdir(parents=True)
    (ckpt / "dist" / ".metadata").write_bytes(b"")
    if optimizer_format:  # a resume reads it
        torch.save({"trainer": {}}, ckpt / "trainer_state.pt")
    else:
        (ckpt / "trainer_state.pt").write_bytes(b"")
    (ckpt / "meta.json").write_text(json.dumps({"format": "megatron-prune/1", "iteration": 2, "tokenizer": "tiny",
                                                "arch": get_preset("tiny").to_dict(), "has_optimizer": has_optimizer,
                                                **({"optimizer_format": optimizer_format, "reference_load": None}
                                                   if optimizer_format else {})}))
    return str(root)


WARNINGS = [
    # model and parallelism
    pytest.param("dpo", ["--moe-aux-loss-coeff", "0.01"],
                 "--moe-aux-loss-coeff 0.01 has no effect: the model (qwen3) is dense, it has no mixture-of-experts layers",
                 id="moe-aux-on-dense"),
    pytest.param("grpo", ["--moe-z-loss-coeff", "0.001"],
                 "--moe-z-loss-coeff 0.001 has no effect: the model (qwen3) is dense, it has no mixture-of-experts layers",
                 id="moe-z-on-dense"),
    pytest.param("dpo", ["--moe-token-dispatcher", "allgather"],
                 "--moe-token-dispatcher allgather has no effect: the model (qwen3) is dense, it has no "
                 "mixture-of-experts layers", id="dispatcher-on-dense"),
    pytest.param("dpo", ["--expert-model-parallel-size", "1"],
                 "--expert-model-parallel-size 1 has no effect: the model (qwen3) is dense, it has no "
                 "mixture-of-experts layers", id="ep1-on-dense"),
    pytest.param("dpo", ["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "moe"],
                 "--recompute-modules core_attn moe names moe, which has no effect: the model (qwen3) is dense, it has "
                 "no mixture-of-experts layers", id="recompute-moe-on-dense"),
    pytest.param("dpo", ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "9"],
                 "--recompute-num-layers 9 is more than the layers of each pipeline stage (4; of each model chunk "
                 "under the interleaved schedule): --recompute-method block recomputes the first N layers of each, so every layer "
                 "is recomputed; give at most 4", id="block-recompute-past-the-stage"),
    pytest.param("dpo", ["--lora-rank", "64"],
                 "--lora-rank 64 is not below 64, the narrowest side of the linear_fc1 it adapts: that adapter is "
                 "full-rank and holds more values than the weight it adapts, so LoRA saves nothing there; give a rank "
                 "well below the model's widths", id="lora-rank-at-a-width"),
    pytest.param("dpo", ["--use-distributed-optimizer"],
                 "--use-distributed-optimizer shards nothing at data-parallel size 1: each rank holds its parameters' "
                 "whole optimizer state either way; it only saves that state in the distributed format, which a resume "
                 "then needs --use-distributed-optimizer to read", id="distributed-optimizer-at-dp-1"),
    pytest.param("grpo", ["--tokenizer", "tiny"],
                 "--tokenizer tiny has no effect with --task toy (the toy tasks work on token ids, with no tokenizer)",
                 id="tokenizer-on-toy"),
    pytest.param("grpo", ["--chat-template-kwargs", '{{"enable_thinking": false}}'],
                 '--chat-template-kwargs {"enable_thinking": false} has no effect with --task toy (the toy tasks work '
                 'on token ids, with no tokenizer)', id="template-kwargs-on-toy"),
    pytest.param("dpo", ["--chat-template-kwargs", '{{"enable_thinking": false}}'],
                 '--chat-template-kwargs {"enable_thinking": false} has no effect: the tokenizer tiny has no chat '
                 'template of its own (prompts and responses use the plain transcript format, which takes no '
                 'variables)', id="template-kwargs-without-a-template"),
    # training
    pytest.param("dpo", ["--lr", "0"],
                 "--lr 0 trains nothing: every update is scaled by the learning rate, so the weights never change; "
                 "give --lr > 0", id="lr-0"),
    pytest.param("dpo", ["--train-iters", "5", "--lr-warmup-iters", "5"],
                 "--lr-warmup-iters 5 is not below --train-iters 5: the run ends inside the warm-up, so the learning "
                 "rate never reaches --lr 0.001; lower --lr-warmup-iters below --train-iters", id="warmup-outlasts-run"),
    pytest.param("dpo", ["--train-iters", "5", "--lr-warmup-iters", "8", "--lr-decay-style", "cosine"],
                 None, id="decay-after-the-run"),  # two lines: checked below
    pytest.param("dpo", ["--min-lr", "1e-5"],
                 "--min-lr 1e-05 has no effect with --lr-decay-style constant (the rate stays at --lr after the "
                 "warm-up); --lr-decay-style linear or cosine decays to it", id="min-lr-constant"),
    pytest.param("dpo", ["--optimizer", "sgd", "--adam-eps", "1e-6"],
                 "--adam-eps 1e-06 has no effect with --optimizer sgd (it is Adam's epsilon)", id="adam-eps-with-sgd"),
    pytest.param("dpo", ["--optimizer", "sgd", "--adam-beta2", "0.99"],
                 "--adam-beta2 0.99 has no effect with --optimizer sgd (it is one of Adam's moment decays)",
                 id="adam-beta-with-sgd"),
    pytest.param("dpo", ["--optimizer", "sgd", "--adam-beta1", "0.8"],
                 "--adam-beta1 0.8 has no effect with --optimizer sgd (it is one of Adam's moment decays)",
                 id="adam-beta1-with-sgd"),
    pytest.param("grpo", ["--sgd-momentum", "0.5"],
                 "--sgd-momentum 0.5 has no effect with --optimizer adam (it is SGD's momentum: pass --optimizer sgd "
                 "to use it)", id="momentum-with-adam"),
    pytest.param("grpo", ["--max-prompt-length", "8", "--seq-length", "64"],
                 "--max-prompt-length 8 has no effect with --task toy: its prompts are --toy-prompt-length 3 tokens",
                 id="max-prompt-length-on-toy"),
    # DPO pruning
    pytest.param("dpo", ["--prune-branch-chosen-prob", "0.7"],
                 "--prune-branch-chosen-prob 0.7 has no effect without --prune-branch (it is the chosen branch's "
                 "keep probability under branch pruning)", id="chosen-prob-without-branch"),
    pytest.param("dpo", ["--prune-preset", "study", "--no-prune-branch", "--prune-branch-chosen-prob", "0.7"],
                 "--prune-branch-chosen-prob 0.7 has no effect without --prune-branch (it is the chosen branch's "
                 "keep probability under branch pruning)", id="chosen-prob-with-preset-branch-off"),
    pytest.param("dpo", ["--prune-preset", "study", "--prune-position-ratio", "0.5", "--prune-seq-min-ratio", "0.7",
                         "--prune-branch", "--prune-branch-chosen-prob", "0.4"],
                 "--prune-preset study has no effect: --prune-position-ratio, --prune-seq-min-ratio, --prune-branch "
                 "and --prune-branch-chosen-prob, all given as well, override every value it sets",
                 id="preset-fully-overridden"),
    # stopping early
    pytest.param("dpo", ["--exit-signal", "SIGUSR1"],
                 "--exit-signal SIGUSR1 has no effect without --exit-signal-handler (it is the signal that handler "
                 "catches)", id="exit-signal-without-handler"),
    pytest.param("dpo", ["--train-iters", "4", "--exit-interval", "4"],
                 "--exit-interval 4 has no effect: its first multiple is not below --train-iters 4, where the run ends anyway",
                 id="exit-interval-past-the-run"),
    pytest.param("dpo", ["--train-iters", "4", "--save", "{tmp}/ckpt", "--save-interval", "10"],
                 "--save-interval 10 has no effect: its first multiple is not below --train-iters 4, where the run "
                 "saves anyway", id="save-interval-past-the-run"),
    pytest.param("dpo", ["--train-iters", "4", "--eval-data-path", HELDOUT, "--eval-interval", "4"],
                 "--eval-interval 4 has no effect: its first multiple is not below --train-iters 4, where the run "
                 "evaluates anyway", id="eval-interval-past-the-run"),
    # GRPO
    pytest.param("grpo", ["--toy-num-digits", "4", "--task", "gsm8k", "--data-path", GSM8K],
                 "--toy-num-digits 4 has no effect with --task gsm8k (it shapes the toy tasks' prompts)",
                 id="toy-flag-on-gsm8k"),
    pytest.param("grpo", ["--toy-num-prompts", "64", "--task", "gsm8k", "--data-path", GSM8K],
                 "--toy-num-prompts 64 has no effect with --task gsm8k (it shapes the toy tasks' prompts)",
                 id="toy-num-prompts-on-gsm8k"),
    pytest.param("grpo", ["--skip-invalid-records"],
                 "--skip-invalid-records has no effect with --task toy (its prompts are generated: there are no "
                 "records to skip)", id="skip-invalid-on-toy"),
    pytest.param("grpo", ["--temperature", "0", "--top-p", "0.9"], None, id="greedy"),  # two lines: checked below
    pytest.param("grpo", ["--clip-eps-high", "0.28"],
                 "--clip-eps-high 0.28 has no effect with --ppo-epochs 1 and --minibatches 1: each rollout feeds one "
                 "update, whose PPO ratio is exactly 1, so nothing is clipped", id="clip-with-one-update"),
    pytest.param("grpo", ["--clip-eps-low", "0.1"],
                 "--clip-eps-low 0.1 has no effect with --ppo-epochs 1 and --minibatches 1: each rollout feeds one "
                 "update, whose PPO ratio is exactly 1, so nothing is clipped", id="clip-low-with-one-update"),
    pytest.param("grpo", ["--no-std-normalization", "--advantage-std", "sample"],
                 "--advantage-std sample has no effect with --no-std-normalization (the advantages are not divided "
                 "by a std)", id="advantage-std-without-normalization"),
    # DPPO
    pytest.param("grpo", ["--dppo-completion-prune-rate", "0.3", "--dppo-prompt-floor", "0.2"],
                 "--dppo-prompt-floor 0.2 has no effect without --dppo-prompt-prune-rate > 0 (no prompt is pruned)",
                 id="prompt-floor-without-rate"),
    pytest.param("grpo", ["--dppo-history-score", "informative"],
                 "--dppo-history-score informative has no effect without --dppo-prompt-prune-rate > 0 (no prompt is "
                 "pruned)", id="history-without-rate"),
    pytest.param("grpo", ["--dppo-prompt-prune-rate", "0.3", "--dppo-sampling", "independent"],
                 "--dppo-sampling independent has no effect without --dppo-completion-prune-rate > 0 (no completion "
                 "is pruned)", id="completion-sampling-without-rate"),
    pytest.param("grpo", ["--dppo-completion-floor", "0.1"],
                 "--dppo-completion-floor 0.1 has no effect without --dppo-completion-prune-rate > 0 (no completion "
                 "is pruned)", id="completion-floor-without-rate"),
    pytest.param("grpo", ["--pack-window", "8"],
                 "--pack-window 8 has no effect without --dense-packing (it is the packer's sorting window)",
                 id="pack-window-without-packing"),
    pytest.param("grpo", ["--kl-beta", "0.1", "--no-skip-zero-advantage"],
                 "--no-skip-zero-advantage has no effect with --kl-beta 0.1: with a KL term every completion has a "
                 "gradient, so none is skipped", id="no-skip-with-kl"),
]


@pytest.mark.parametrize("cli, extra, line", WARNINGS)
def test_an_ignored_flag_is_said_in_one_line_and_the_run_goes_on(cli, extra, line, monkeypatch, capsys, tmp_path):
    base = DPO if cli == "dpo" else TINY_GRPO
    code, err = _dry_run(cli, [*base, *(a.format(tmp=tmp_path) for a in extra)], monkeypatch, capsys)
    assert code == 0, err
    if line is not None:
        assert err == [WARNING + line]


def test_two_ignored_flags_give_two_lines(monkeypatch, capsys):
    code, err = _dry_run("dpo", [*DPO, "--train-iters", "5", "--lr-warmup-iters", "8", "--lr-decay-style", "cosine"],
                         monkeypatch, capsys)
    assert code == 0 and err == [
        WARNING + "--lr-warmup-iters 8 is not below --train-iters 5: the run ends inside the warm-up, so the learning "
        "rate never reaches --lr 0.001; lower --lr-warmup-iters below --train-iters",
        WARNING + "--lr-decay-style cosine has no effect: --lr-warmup-iters 8 is not below --train-iters 5, so the run "
        "ends before any decay"], err
    code, err = _dry_run("grpo", [*TINY_GRPO, "--temperature", "0", "--top-p", "0.9"], monkeypatch, capsys)
    assert code == 0 and err == [
        WARNING + "--top-p 0.9 has no effect with --temperature 0 (greedy sampling takes the most likely token)",
        WARNING + "--temperature 0 samples greedily: the --group-size 8 completions of a prompt are identical, so their "
        "rewards are equal, every advantage is 0 and the policy term trains nothing; give --temperature > 0"], err


def test_ignored_reference_and_finetune_flags(tmp_path, monkeypatch, capsys):
    """The flags whose rule looks at a --load or --ref-load checkpoint."""
    ref = _checkpoint(tmp_path / "ref")
    code, err = _dry_run("grpo", [*TINY_GRPO, "--ref-load", ref], monkeypatch, capsys)
    assert code == 0 and err == [WARNING + f"--ref-load {ref} has no effect with --kl-beta 0: without a KL term there "
                                 "is no reference model (give --kl-beta > 0 to use it)"], err
    assert _dry_run("grpo", [*TINY_GRPO, "--ref-load", ref, "--kl-beta", "0.1"], monkeypatch, capsys) == (0, [])

    fresh = tmp_path / "fresh"  # --save X --load X before the first checkpoint: the run starts fresh
    code, err = _dry_run("dpo", [*DPO, "--save", str(fresh), "--load", str(fresh), "--finetune"],
                         monkeypatch, capsys)
    assert code == 0 and err == [WARNING + f"--finetune has no effect: --load {fresh} holds no complete checkpoint "
                                 "yet, so the run starts fresh"], err

    converted = _checkpoint(tmp_path / "converted", has_optimizer=False)
    code, err = _dry_run("dpo", [*DPO[2:], "--load", converted, "--finetune"], monkeypatch, capsys)
    assert code == 0 and err == [WARNING + f"--finetune has no effect: --load {converted} holds weights only (a "
                                 "converted model, no optimizer state), which a run always starts from at iteration "
                                 "0"], err
    code, err = _dry_run("dpo", [*DPO[2:], "--load", converted, "--override-opt-param-scheduler"], monkeypatch, capsys)
    assert code == 0 and err == [WARNING + "--override-opt-param-scheduler has no effect: the run resumes no "
                                 "learning-rate schedule (it starts at iteration 0 with this launch's flags anyway)"], err

    trained = _checkpoint(tmp_path / "trained")
    code, err = _dry_run("dpo", [*DPO[2:], "--load", trained, "--finetune", "--lora-rank", "4"],
                         monkeypatch, capsys)
    assert code == 0 and err == [WARNING + f"--finetune has no effect with --lora-rank 4: --load {trained} holds no "
                                 "adapters, so it is the frozen base that LoRA starts from at iteration 0 anyway"], err
    assert _dry_run("dpo", [*DPO[2:], "--load", trained, "--finetune"], monkeypatch, capsys) == (0, [])


@pytest.mark.parametrize("cli, extra, line", [
    pytest.param("dpo", ["--lora-targets", "linear_qkv"],
                 "--lora-targets linear_qkv needs --lora-rank > 0 (LoRA is off at rank 0): give --lora-rank, or drop "
                 "--lora-targets", id="targets-at-rank-0"),
    pytest.param("grpo", ["--lora-dropout", "0"],
                 "--lora-dropout 0 needs --lora-rank > 0 (LoRA is off at rank 0): give --lora-rank, or drop "
                 "--lora-dropout", id="dropout-0-at-rank-0"),
])
def test_a_contradicting_flag_is_a_usage_error(cli, extra, line, monkeypatch, capsys):
    base = DPO if cli == "dpo" else TINY_GRPO
    code, err = _dry_run(cli, [*base, *extra, "--min-lr", "0"], monkeypatch, capsys)
    assert code == 2 and err == [f"megatron-prune: error: {line}"], err  # and no warning before it


def test_the_distributed_optimizer_warns_only_where_it_shards_nothing(tmp_path, monkeypatch, capsys):
    """At data-parallel size 1 it shards nothing, unless the run resumes state saved in its format (which
    needs the flag); at 2 data-parallel ranks it shards."""
    flag = ["--use-distributed-optimizer"]
    code, err = _dry_run("grpo", [*TINY_GRPO, *flag, "--tensor-model-parallel-size", "2"], monkeypatch, capsys, world=2)
    assert code == 0 and len(err) == 1 and err[0].startswith(WARNING + "--use-distributed-optimizer shards nothing"), err
    assert _dry_run("grpo", [*TINY_GRPO, *flag], monkeypatch, capsys, world=2) == (0, [])
    assert _dry_run("dpo", [*DPO, *flag, "--micro-batch-size", "1", "--pipeline-model-parallel-size", "2"],
                    monkeypatch, capsys, world=4) == (0, [])
    saved = _checkpoint(tmp_path / "saved", optimizer_format="distributed/fully_reshardable")
    assert _dry_run("dpo", [*DPO[2:], "--load", saved, *flag], monkeypatch, capsys) == (0, [])
    code, err = _dry_run("dpo", [*DPO[2:], "--load", saved, *flag, "--finetune"], monkeypatch, capsys)
    assert code == 0 and len(err) == 1 and err[0].startswith(WARNING + "--use-distributed-optimizer shards nothing"), err


def test_block_recompute_is_judged_per_model_chunk_under_the_interleaved_schedule(monkeypatch, capsys):
    """With 2 pipeline stages of 2 model chunks each, the tiny preset's 4 layers are 1 per chunk: block
    recompute of 2 layers already recomputes every layer, though each stage holds 2."""
    argv = [*DPO, "--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
            "--recompute-granularity", "full", "--recompute-method", "block"]
    code, err = _dry_run("dpo", [*argv, "--recompute-num-layers", "2"], monkeypatch, capsys, world=2)
    assert code == 0 and err == [
        WARNING + "--recompute-num-layers 2 is more than the layers of each pipeline stage (1; of each model chunk "
        "under the interleaved schedule): --recompute-method block recomputes the first N layers of each, so every "
        "layer is recomputed; give at most 1"], err
    assert _dry_run("dpo", [*argv, "--recompute-num-layers", "1"], monkeypatch, capsys, world=2) == (0, [])


def test_only_rank_0_warns(monkeypatch, capsys):
    argv = [*DPO, "--tensor-model-parallel-size", "2", "--prune-branch-chosen-prob", "0.7"]
    code, err = _dry_run("dpo", argv, monkeypatch, capsys, world=2, rank=1)
    assert code == 0 and err == []
    code, err = _dry_run("dpo", argv, monkeypatch, capsys, world=2, rank=0)
    assert code == 0 and len(err) == 1 and err[0].startswith(WARNING + "--prune-branch-chosen-prob 0.7"), err


NO_WARNING = [
    pytest.param("dpo", ["--model-preset", "tiny", "--data-path", SAMPLE], id="dpo-defaults"),
    pytest.param("dpo", ["--model-preset", "tiny", "--data-path", SAMPLE, "--prune-preset", "study"], id="study"),
    pytest.param("dpo", ["--model-preset", "tiny", "--data-path", SAMPLE, "--prune-preset", "study",
                         "--no-prune-branch"], id="study-branch-off"),
    pytest.param("dpo", ["--model-preset", "tiny", "--data-path", SAMPLE, "--prune-preset", "study",
                         "--prune-branch-chosen-prob", "0.7"], id="study-chosen-prob"),
    pytest.param("dpo", [*TINY_DPO, "--prune-branch-chosen-prob", "0.7", "--optimizer", "sgd", "--sgd-momentum", "0",
                         "--lr-decay-style", "cosine", "--min-lr", "1e-5", "--lr-warmup-iters", "2"], id="dpo-in-use"),
    pytest.param("dpo", ["--model-preset", "tiny-moe", "--data-path", SAMPLE, "--moe-aux-loss-coeff", "0.01",
                         "--moe-z-loss-coeff", "0.001", "--moe-token-dispatcher", "allgather", "--recompute-granularity",
                         "selective", "--recompute-modules", "moe"], id="moe-flags-on-moe"),
    pytest.param("dpo", [*TINY_DPO, "--lora-rank", "4", "--lora-alpha", "8", "--lora-dropout", "0.1",
                         "--lora-targets", "linear_qkv"], id="lora-flags-with-lora"),
    pytest.param("dpo", [*TINY_DPO, "--recompute-granularity", "full", "--recompute-method", "block",
                         "--recompute-num-layers", "4", "--lora-rank", "32"], id="block-recompute-and-lora-rank-that-fit"),
    pytest.param("grpo", TINY_GRPO, id="grpo-defaults"),
    pytest.param("grpo", [*TINY_GRPO, "--dppo-prompt-prune-rate", "0.3", "--dppo-completion-prune-rate", "0.3",
                          "--dppo-prompt-floor", "0.2", "--dppo-completion-floor", "0.2", "--dppo-sampling",
                          "independent", "--dppo-prompt-sampling", "systematic", "--dppo-history-decay", "0.9",
                          "--dense-packing", "--pack-window", "8", "--ppo-epochs", "2", "--clip-eps-high", "0.28",
                          "--temperature", "0.7", "--top-p", "0.9", "--advantage-std", "sample",
                          "--toy-num-digits", "4"], id="grpo-in-use"),
    pytest.param("grpo", [*TINY_GRPO, "--kl-beta", "0.1", "--minibatches", "2", "--clip-eps-low", "0.1"],
                 id="grpo-kl-and-minibatches"),
    pytest.param("grpo", [*TINY_GRPO, "--skip-zero-advantage"], id="skip-zero-advantage-without-kl"),
    pytest.param("grpo", ["--model-preset", "tiny", "--task", "gsm8k", "--data-path", GSM8K, "--tokenizer", "tiny",
                          "--max-prompt-length", "64", "--skip-invalid-records"], id="grpo-gsm8k"),
]


@pytest.mark.parametrize("cli, argv", NO_WARNING)
def test_defaults_presets_and_flags_in_use_warn_nothing(cli, argv, monkeypatch, capsys):
    assert _dry_run(cli, argv, monkeypatch, capsys) == (0, [])


# --------------------------------------------------------------------------- the README and the examples

_EXAMPLES = [
    ("examples/quickstart.sh", {}),
    ("examples/grpo_cpu.sh", {}),
    ("examples/grpo_cpu.sh", {"PRUNE_PROMPTS": "0", "PRUNE_COMPLETIONS": "0", "PACK": "0"}),  # its plain-GRPO form
    ("examples/dpo_multinode.sh", {"GPUS": "2", "TP": "2", "SAVE": "ckpt"}),
    ("examples/dpo_qwen3_4b_8gpu.sh", {"HF_MODEL": "/models/Qwen3-4B", "DATA": SAMPLE}),
    ("examples/grpo_qwen3_4b_8gpu.sh", {}),
]


def _example_command(script: str, env: dict[str, str]) -> str:
    proc = subprocess.run(["bash", script], cwd=REPO, env={"PATH": "/usr/bin:/bin", "DRY_RUN": "1", **env},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def _readme_launches() -> list[str]:
    from tests.e2e.test_user_paths import _readme_commands

    return [c for c in _readme_commands() if "-m megatron_prune.dpo" in c or "-m megatron_prune.grpo" in c]


def _as_dry_run(command: str, tmp_path) -> tuple[str, list[str], int]:
    """(cli, argv, world size) of a launch command, made to run here: the tiny preset for an HF model of
    the same (dense Qwen3) family (lengths shrunk to fit its context), the bundled samples for data files that are not here, output paths
    under ``tmp_path`` (a --save and a --load of the same directory stay the same)."""
    words = [w for w in shlex.split(command) if w != "..."]
    at = next(i for i, w in enumerate(words[:-1]) if w == "-m" and words[i + 1].startswith("megatron_prune."))
    cli = words[at + 1].rsplit(".", 1)[1]
    launcher = dict(zip(words[:at], words[1:at]))
    world = int(launcher.get("--nproc-per-node", 1)) * int(launcher.get("--nnodes", 1))
    argv, rest = [], words[at + 2:]
    # the tiny stand-in's context is 1024 tokens, the Qwen3 model's longer: every length shrinks alike
    seq = int(rest[rest.index("--seq-length") + 1]) if "--seq-length" in rest else 0
    shrink = max(1, -(-seq // get_preset("tiny").max_position_embeddings)) if "--hf-model" in rest else 1
    while rest:
        word = rest.pop(0)
        if word == "--hf-model":
            rest.pop(0)
            argv += ["--model-preset", "tiny"]
        elif word in ("--save", "--load", "--metrics-jsonl", "--tensorboard-dir"):
            argv += [word, str(tmp_path / rest.pop(0).strip("/").replace("/", "_"))]
        elif word == "--data-path" and not (REPO / rest[0]).exists():
            rest.pop(0)
            argv += [word, SAMPLE if cli == "dpo" else GSM8K]
        elif word in ("--seq-length", "--max-prompt-length", "--max-new-tokens"):
            argv += [word, str(int(rest.pop(0)) // shrink)]
        else:
            argv.append(word)
    return cli, argv, world


def test_the_example_and_readme_commands_warn_nothing(tmp_path, monkeypatch, capsys):
    commands = [_example_command(script, env) for script, env in _EXAMPLES] + _readme_launches()
    assert len(commands) == len(_EXAMPLES) + 2  # the README's DPO and GRPO launches
    for command in commands:
        cli, argv, world = _as_dry_run(command, tmp_path)
        code, err = _dry_run(cli, argv, monkeypatch, capsys, world=world)
        assert (code, err) == (0, []), f"{command}\n  as {argv}: {err}"


def test_schedule_flags_of_a_resume_are_not_judged(tmp_path, monkeypatch, capsys):
    """A resume keeps the checkpoint's learning-rate schedule (and its note says which flags it
    ignores), so --lr 0 or a long warm-up is not said to train nothing, nor --min-lr to do nothing
    under the default constant style; with
    --override-opt-param-scheduler the flags set the schedule again, and are judged."""
    saved = _checkpoint(tmp_path / "saved", optimizer_format="local")
    flags = [*DPO[2:], "--load", saved, "--train-iters", "5", "--lr", "0", "--lr-warmup-iters", "8"]
    assert _dry_run("dpo", flags, monkeypatch, capsys) == (0, [])
    code, err = _dry_run("dpo", [*flags, "--override-opt-param-scheduler"], monkeypatch, capsys)
    assert code == 0 and [line.split(" ", 3)[2] for line in err] == ["--lr", "--lr-warmup-iters"], err
    flags = [*DPO[2:], "--load", saved, "--min-lr", "1e-5"]
    assert _dry_run("dpo", flags, monkeypatch, capsys) == (0, [])
    code, err = _dry_run("dpo", [*flags, "--override-opt-param-scheduler"], monkeypatch, capsys)
    assert code == 0 and [line.split(" ", 3)[2] for line in err] == ["--min-lr"], err
