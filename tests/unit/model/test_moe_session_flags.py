"""The layout and mixture-of-experts flags reach the model the session builds: the session's
parallel config carries every one of them, and a MoE layout the model refuses stops the dry run."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_prune.config import ModelConfig
from megatron_prune.data import HH_RLHF_SAMPLE
from megatron_prune.model.provider import ParallelConfig
from megatron_prune.training.session import parallel_config

SAMPLE = HH_RLHF_SAMPLE
# Non-default values of every flag the model config and the parallel config share.
GIVEN = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
             sequence_parallel=True, bf16=True, expert_model_parallel_size=2, moe_token_dispatcher="allgather",
             moe_aux_loss_coeff=0.02, moe_z_loss_coeff=0.003)


def test_session_parallel_config_carries_every_layout_flag():
    shared = {f.name for f in dataclasses.fields(ModelConfig)} & {f.name for f in dataclasses.fields(ParallelConfig)}
    # --recompute-activations arrives as Megatron's recompute fields (recompute_options).
    assert shared - {"recompute"} == set(GIVEN), "a flag shared with ParallelConfig is missing from this test"
    model = ModelConfig(model_preset="tiny-moe", recompute_granularity="selective", recompute_modules=["moe"], **GIVEN)
    got = parallel_config(model)
    default = ParallelConfig()
    for name, value in GIVEN.items():
        assert getattr(default, name) != value, name
        assert getattr(got, name) == value, name
    assert got.recompute_options == {"recompute_granularity": "selective", "recompute_modules": ["moe"]}


@pytest.mark.parametrize("argv, message", [
    (["--expert-model-parallel-size", "2", "--moe-token-dispatcher", "allgather"],
     "--moe-token-dispatcher allgather needs --expert-model-parallel-size 1"),
    (["--moe-z-loss-coeff", "-0.5"], "--moe-z-loss-coeff must be a finite number >= 0, got -0.5"),
], ids=["allgather-at-ep2", "negative-z-loss-coeff"])
def test_dry_run_refuses_a_moe_layout_the_model_cannot_run(argv, message, capsys, monkeypatch):
    """Refused with exit 2 before any work; the same launch with alltoall (and no z-loss) passes."""
    from megatron_prune.dpo.__main__ import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    base = ["--model-preset", "tiny-moe", "--data-path", SAMPLE, "--dry-run"]
    with pytest.raises(SystemExit) as exc:
        main([*base, *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    main([*base, "--expert-model-parallel-size", "2", "--moe-token-dispatcher", "alltoall"])
