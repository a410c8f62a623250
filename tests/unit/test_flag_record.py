"""What a resume says about the flags it changed: those a checkpoint records, and the schedule's."""

from __future__ import annotations

from megatron_prune.config import CheckpointConfig, ModelConfig, TrainConfig
from megatron_prune.training import loop, session


def _record(**model) -> dict:
    configs = {"ModelConfig": ModelConfig(model_preset="tiny-moe", **model), "TrainConfig": TrainConfig(),
               "CheckpointConfig": CheckpointConfig()}
    return session.flag_record(configs)


def test_the_router_loss_coefficients_are_recorded_and_a_change_is_named(capsys, monkeypatch):
    """--moe-aux-loss-coeff and --moe-z-loss-coeff add terms to the loss, so a resume that changes
    them says so, as for every objective flag."""
    saved, resumed = _record(moe_aux_loss_coeff=0.01), _record(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.001)
    assert saved["--moe-aux-loss-coeff"] == 0.01 and saved["--moe-z-loss-coeff"] == 0.0
    monkeypatch.setattr(loop, "is_logging_rank", lambda: True)
    loop._say_flags_changed(saved, resumed)
    assert ("resuming with flags that differ from the checkpoint's run: --moe-aux-loss-coeff 0.1 (checkpoint: 0.01), "
            "--moe-z-loss-coeff 0.001 (checkpoint: 0.0)") in capsys.readouterr().out


def test_the_chat_template_variables_are_recorded_and_a_change_is_named(capsys, monkeypatch):
    """--chat-template-kwargs changes every prompt and response the run trains on: a resume that drops
    or changes it says so; the same variables spelled otherwise are no change."""
    saved = _record(chat_template_kwargs='{"enable_thinking": false}')
    assert saved["--chat-template-kwargs"] == '{"enable_thinking": false}'
    monkeypatch.setattr(loop, "is_logging_rank", lambda: True)
    loop._say_flags_changed(saved, _record(chat_template_kwargs='{ "enable_thinking":false }'))
    assert "differ" not in capsys.readouterr().out
    loop._say_flags_changed(saved, _record())
    assert ("resuming with flags that differ from the checkpoint's run: --chat-template-kwargs None (checkpoint: "
            '{"enable_thinking": false})') in capsys.readouterr().out


def test_a_horizon_set_by_the_warm_up_is_not_named_as_train_iters(capsys, monkeypatch):
    """A warm-up that outlasts --train-iters sets the decay horizon to one step past it; the resume
    note names where the number comes from (it read "--train-iters 11" for --train-iters 4)."""
    monkeypatch.setattr(loop, "is_logging_rank", lambda: True)
    launch = loop._schedule_of(TrainConfig(train_iters=4, lr_warmup_iters=10, lr_decay_style="linear"))
    saved = {**launch, "lr_warmup_steps": 0, "lr_decay_steps": 2, "num_steps": 2}
    loop._say_schedule_kept(launch, saved, train_iters=4, override=False)
    out = capsys.readouterr().out
    assert "--lr-warmup-iters 10 (checkpoint: 0), the decay horizon of 11 steps (--lr-warmup-iters 10 + 1) " \
           "(checkpoint: 2)" in out, out
    assert "--train-iters 11" not in out


def test_the_end_of_schedule_warning_names_only_the_steps_this_run_trains(capsys, monkeypatch):
    """A checkpoint past its decay's end (a run already extended once): the warning names the steps
    after the checkpoint, not those it trained; at the checkpoint's step there is none to name."""
    monkeypatch.setattr(loop, "is_logging_rank", lambda: True)
    launch = loop._schedule_of(TrainConfig(train_iters=10, lr_decay_style="linear", lr=1e-3, min_lr=1e-4))
    saved = {**launch, "lr_decay_steps": 4, "num_steps": 8}
    loop._say_schedule_kept(launch, saved, train_iters=10, override=False)
    out = capsys.readouterr().out
    assert "the checkpoint's linear schedule ends at step 4, so steps 9-10 of --train-iters 10 run at the " \
           "schedule's final --min-lr 0.0001" in out, out
    loop._say_schedule_kept(launch, {**saved, "num_steps": 10}, train_iters=10, override=False)
    assert "schedule ends" not in capsys.readouterr().out
    loop._say_schedule_kept(launch, {**saved, "num_steps": 2}, train_iters=10, override=False)
    assert "so steps 5-10 of --train-iters 10" in capsys.readouterr().out


def test_lora_targets_in_another_order_are_no_change(capsys, monkeypatch):
    """The targets are a set (a resume accepts them in any order): another order or spacing is not
    named as a changed flag; another set is."""
    from megatron_prune.lora_config import LoRAConfig

    def record(targets):
        return session.flag_record({"ModelConfig": ModelConfig(model_preset="tiny"), "TrainConfig": TrainConfig(),
                                    "CheckpointConfig": CheckpointConfig(),
                                    "LoRAConfig": LoRAConfig(rank=4, targets=targets)})

    monkeypatch.setattr(loop, "is_logging_rank", lambda: True)
    saved = record("linear_qkv,linear_proj,linear_fc1,linear_fc2")
    loop._say_flags_changed(saved, record("linear_fc2, linear_qkv,linear_proj,linear_fc1"))
    assert "differ" not in capsys.readouterr().out
    loop._say_flags_changed(saved, record("linear_qkv,linear_proj"))
    assert "--lora-targets linear_qkv,linear_proj (checkpoint: linear_qkv,linear_proj,linear_fc1,linear_fc2)" in \
        capsys.readouterr().out
