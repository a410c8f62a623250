"""The flags a checkpoint records, which a resume that changes them names."""

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
