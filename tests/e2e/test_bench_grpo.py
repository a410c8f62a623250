"""Smoke test of tools/bench_grpo.py: one tiny step of every mode through the real tool."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.conftest import REPO, run_cmd

MODES = ["grpo", "dppo", "dppo_completion", "dppo_prompt", "filter", "cppo"]
TINY = ["--seeds", "1", "--steps", "1", "--rounds", "1", "--prompts", "4", "--num-prompts", "8", "--group-size", "4",
        "--max-new-tokens", "3", "--eval-every", "1", "--eval-prompts", "4", "--eval-samples", "2"]


def _bench(tmp_path, args, name):
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, str(REPO / "tools" / "bench_grpo.py"), *TINY, *args, "--json", str(out),
           "--plot", str(tmp_path / f"{name}.png")]
    run_cmd(cmd, log=tmp_path / f"{name}.log", timeout=900).check_ok()
    assert (tmp_path / f"{name}.png").stat().st_size > 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_every_mode_one_step(tmp_path):
    # the toy task's fractional reward: groups of 4 almost never tie, so the unpruned gradient is not 0
    # --no-skip-zero-advantage: grpo trains every completion (the skip itself is checked in test_grpo.py)
    result = _bench(tmp_path, ["--task", "toy", "--modes", *MODES, "--no-match-time", "--kv-cache",
                               "--grad-variance", "2", "--grad-variance-every", "1", "--no-skip-zero-advantage"], "modes")
    assert list(result["modes"]) == MODES
    for mode, s in result["modes"].items():
        for key in ("speedup_vs_grpo", "heldout_reward_final", "heldout_reward_at_grpo_time", "records"):
            assert key in s, (mode, key)
        steps = [r for r in s["records"] if r["step"] >= 0]
        assert [r["step"] for r in steps] == [0]
        for key in ("step", "seed", "time_s", "cum_time_s", "heldout_reward", "train_tokens", "rollout_tokens",
                    "density", "rollout_time_s", "reference_time_s", "old_logprob_time_s", "update_time_s",
                    "kept_prompt_fraction", "kept_completion_fraction", "weight_max", "weight_mean"):
            assert key in steps[0], (mode, key)
        assert 0.0 <= s["heldout_reward_final"] <= 1.0
        assert s["records"][0]["step"] == -1 and "heldout_reward" in s["records"][0]  # before training
        if mode != "grpo":
            assert s["grad_rel_mse"] >= 0.0
    modes = result["modes"]
    assert modes["grpo"]["speedup_vs_grpo"] == 1.0
    assert modes["grpo"]["weight_max"] == 1.0 and modes["grpo"]["kept_completion_fraction"] == 1.0
    assert modes["dppo_completion"]["kept_prompt_fraction"] == 1.0
    assert modes["cppo"]["kept_completion_fraction"] == 0.5 and modes["cppo"]["weight_max"] == 1.0
    assert modes["grpo"]["heldout_reward_at_grpo_steps"] == modes["grpo"]["heldout_reward_final"]


@pytest.mark.slow
def test_tensor_parallel_with_kl(tmp_path):
    # the gradient-variance probe keeps the reference log-probs a KL term needs, and at the second
    # step (--ppo-epochs 2: inside the first rollout) rolls that rollout's prompts out again
    result = _bench(tmp_path, ["--task", "toy-binary", "--modes", "grpo", "dppo", "--tensor-model-parallel-size", "2",
                               "--kl-beta", "0.05", "--kv-cache", "--no-match-time", "--dppo-prompt-sampling",
                               "systematic", "--prompt-floor", "0.3", "--completion-floor", "0.25",
                               "--grad-variance", "1", "--grad-variance-every", "1", "--ppo-epochs", "2",
                               "--steps", "2"], "tp2")
    assert result["config"]["tensor_model_parallel_size"] == 2
    # (the ratio itself may be nan: toy-binary's first groups tie, and the unpruned gradient is then 0)
    probed = [r for r in result["modes"]["dppo"]["records"] if r["step"] >= 0]
    assert [r["step"] for r in probed] == [0, 1] and all("grad_rel_mse" in r for r in probed), probed
    for s in result["modes"].values():
        assert s["reference_time_s"] > 0.0
    # the DPPO options reach the objective's config (recorded as the run used it) and bound its weights
    assert result["config"]["dppo_prompt_sampling"] == "systematic"
    dppo_config = result["config"]["dppo_config"]
    for part in ("prompt_floor=0.3", "completion_floor=0.25", "prompt_sampling='systematic'"):
        assert part in dppo_config, (part, dppo_config)
    assert 1.0 <= result["modes"]["dppo"]["weight_max_max"] <= 1.0 / (0.3 * 0.25) + 1e-6


def test_unreachable_prompt_floor_is_refused_before_any_run(tmp_path):
    # rate 0.5 with floor 0.6: every prompt keeps >= 0.6, so at most 0.4 can be pruned
    cmd = [sys.executable, str(REPO / "tools" / "bench_grpo.py"), "--modes", "grpo", "dppo", "--prompt-rate", "0.5",
           "--prompt-floor", "0.6", "--json", str(tmp_path / "never.json")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "at most 1 - floor = 0.4 can be pruned" in done.stderr
    assert not (tmp_path / "never.json").exists()


def _keep_all_variance_after_updates() -> list[dict]:
    """bench_grpo.gradient_variance with a keep-everything rule at steps 0-2 of a GRPO run whose
    optimizer steps in between: every "pruned" gradient is the unpruned one."""
    sys.path.insert(0, str(REPO / "tools"))
    import bench_grpo

    from megatron_prune.config import TrainConfig
    from megatron_prune.grpo.config import GRPOConfig
    from megatron_prune.grpo.trainer import build_objective
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import OptimConfig, build_optimizer, setup_model
    from megatron_prune.training.parallel import model_parallel

    args = bench_grpo.parse_args(["--task", "toy-binary", "--prompts", "8", "--group-size", "4"])
    par = ParallelConfig()
    out = []
    with model_parallel(par, seed=5):
        arch = get_preset("tiny")
        policy = setup_model(arch, par, seed=5)
        optimizer = build_optimizer(policy, OptimConfig(optimizer="adam", lr=1e-2), bf16=False)
        configs = {"TrainConfig": TrainConfig(global_batch_size=args.prompts, micro_batch_size=args.micro_batch_size,
                                              seq_length=args.seq_length, seed=5),
                   "GRPOConfig": GRPOConfig(task=args.task, group_size=args.group_size,
                                            max_new_tokens=args.max_new_tokens),
                   "DPPOArgs": bench_grpo.dppo_args("grpo", args)}
        source = bench_grpo._source(args, arch=arch, seed=5, heldout=False)
        objective = build_objective(configs=configs, arch=arch, policy=policy, reference=None, source=source)
        for step in range(3):
            out.append(bench_grpo.gradient_variance(objective, rule=bench_grpo._KeepAll(), step=step, draws=2))
            for chunk in policy:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            objective.train_step(step)
            optimizer.step()
    return out


@pytest.mark.slow
def test_gradient_variance_of_an_identical_rule_is_zero_after_optimizer_steps():
    """The benchmark's gradient-variance probe, given a rule that keeps everything, reports 0 at
    every step (after an optimizer step each param.grad aliases its main_grad: a probe that does
    not clear it counts the first gradient twice, which read as a relative error of 0.09-0.25)."""
    from tests.dist import run_distributed

    for step, got in enumerate(run_distributed(_keep_all_variance_after_updates, 1)[0]):
        assert got["grad_rel_mse"] < 1e-12 and got["grad_rel_bias"] < 1e-12, (step, got)


def _tool(*args, timeout=300):
    return subprocess.run([sys.executable, str(REPO / "tools" / "bench_grpo.py"), *args], capture_output=True,
                          text=True, timeout=timeout)


def test_baselines_train_no_zero_advantage_completion(tmp_path):
    """At --kl-beta 0 every mode leaves zero-advantage completions out (exact there), the biased
    baselines too: a step whose groups all tie trains no token in grpo, filter or cppo alike."""
    out = tmp_path / "tb.json"
    _tool("--task", "toy-binary", "--modes", "grpo", "filter", "cppo", "--seeds", "1", "--steps", "2", "--prompts", "4",
          "--num-prompts", "8", "--group-size", "4", "--eval-prompts", "4", "--eval-samples", "1", "--no-match-time",
          "--json", str(out)).check_returncode()
    modes = json.loads(out.read_text())["modes"]
    steps = {m: [r for r in s["records"] if r["step"] >= 0] for m, s in modes.items()}
    tied = [k for k, r in enumerate(steps["grpo"]) if r["zero_variance_groups"] == 1.0]
    assert tied, "no step of this seed has only tied groups: the case is not exercised"
    for mode in ("filter", "cppo"):
        for k in tied:
            assert steps[mode][k]["zero_variance_groups"] == 1.0  # the same rollout as grpo's
            assert steps[mode][k]["train_tokens"] == 0, (mode, steps[mode][k])


def test_rules_leave_zero_advantages_out_unless_told():
    import torch

    sys.path.insert(0, str(REPO / "tools"))
    import bench_grpo

    adv = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, -1.0, 0.0, 0.5]])
    cppo = bench_grpo.SmallestAdvantageDrop(0.25, skip_zero=True).select_completions(step=0, prompt_ids=[0, 1],
                                                                                    advantages=adv)
    assert cppo.keep.tolist() == [[False] * 4, [True, True, False, True]]
    cppo = bench_grpo.SmallestAdvantageDrop(0.25, skip_zero=False).select_completions(step=0, prompt_ids=[0, 1],
                                                                                     advantages=adv)
    assert cppo.keep.tolist() == [[False, True, True, True], [True, True, False, True]]
    filt = bench_grpo.ZeroVarianceFilter(skip_zero=True).select_completions(step=0, prompt_ids=[0, 1], advantages=adv)
    assert filt.keep.tolist() == [[False] * 4, [True, True, False, True]]
    filt = bench_grpo.ZeroVarianceFilter(skip_zero=False).select_completions(step=0, prompt_ids=[0, 1], advantages=adv)
    assert filt.keep.tolist() == [[False] * 4, [True] * 4]


def _result(path, *, task="toy", seed=1234, modes=("grpo", "dppo"), seeds=(1234,), rounds=(0,)):
    records = [{"step": 0, "seed": s, "round": r, "cum_time_s": 1.0, "time_s": 1.0, "heldout_reward": 0.5}
               for s in seeds for r in rounds]
    path.write_text(json.dumps({"config": {"task": task, "seed": seed, "seeds": len(seeds), "steps": 1, "lr": 0.01},
                                "modes": {m: {"records": records} for m in modes}}))
    return str(path)


@pytest.mark.parametrize("case, expected", [
    ("missing", "--from-json {a}: No such file or directory"),
    ("not-json", "--from-json {a}: not a JSON result of tools/bench_grpo.py"),
    ("bench-dpo", "--from-json {a}: not a JSON result of tools/bench_grpo.py"),
    ("other-task", "--from-json {b}: another experiment than {a}: task 'toy-binary' (in {a}: 'toy')"),
    ("other-modes", "--from-json {b}: modes ['cppo', 'grpo'], {a}: ['dppo', 'grpo']"),
    ("same-run-twice", "--from-json {b}: mode grpo seed 1234 round 0 is also in {a}"),
])
def test_from_json_refuses_files_that_do_not_merge(tmp_path, case, expected):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    if case == "not-json":
        a.write_text("{")
    elif case == "bench-dpo":  # tools/bench_dpo.py's layout: its own modes, records at the top level
        a.write_text(json.dumps({"config": {}, "modes": {"concat": {"speedup_vs_concat": 1.0}}, "records": []}))
    elif case != "missing":
        _result(a)
        _result(b, **{"other-task": dict(task="toy-binary", seeds=(1235,)), "other-modes": dict(modes=("grpo", "cppo"),
                      seeds=(1235,)), "same-run-twice": dict(seed=1234)}[case])
    done = _tool("--from-json", str(a), *([str(b)] if case not in ("missing", "not-json", "bench-dpo") else []),
                 "--json", str(tmp_path / "merged.json"))
    assert done.returncode == 2, done.stderr
    assert expected.format(a=a, b=b) in done.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "merged.json").exists()


def test_from_json_refuses_experiment_flags_it_would_ignore(tmp_path):
    """``--from-json a.json --task gsm8k --modes grpo`` summarised a.json's toy run with all its modes,
    without a word: flags that shape an experiment are refused next to it."""
    a = _result(tmp_path / "a.json")
    done = _tool("--from-json", a, "--task", "gsm8k", "--modes", "grpo", "--json", str(tmp_path / "merged.json"))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith(
        "--from-json summarises the runs its files hold, so --task, --modes would change nothing; drop them")
    assert not (tmp_path / "merged.json").exists()


def test_from_json_merges_batches_of_seeds(tmp_path):
    sys.path.insert(0, str(REPO / "tools"))
    import bench_grpo

    a = _result(tmp_path / "a.json", seeds=(1234, 1235))
    b = _result(tmp_path / "b.json", seed=1236, seeds=(1236,))
    config, records = bench_grpo.load_earlier([a, b])
    assert config["seeds"] == 3 and config["task"] == "toy"
    assert sorted(r["seed"] for r in records["grpo"]) == [1234, 1235, 1236]


@pytest.mark.parametrize("tool", ["bench_grpo.py", "bench_dpo.py"])
def test_missing_data_file_is_one_line_before_any_worker(tmp_path, tool):
    task = ["--task", "gsm8k"] if tool == "bench_grpo.py" else []  # the toy tasks refuse --data-path
    done = subprocess.run([sys.executable, str(REPO / "tools" / tool), *task, "--data-path", str(tmp_path / "none.jsonl"),
                           "--json", str(tmp_path / "never.json")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith(f"--data-path {tmp_path / 'none.jsonl'}: data file not found")
    assert not (tmp_path / "never.json").exists()
