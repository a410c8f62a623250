"""--distributed-timeout-minutes too large for the collectives' clocks: one clear message naming
the flag before any rank works (also under --dry-run), not an OverflowError traceback from every
rank as the process group starts."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import REPO, SAMPLE


def _launch(module, argv, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as exc:
        module.main(argv)
    return exc.value.code, capsys.readouterr().err


@pytest.mark.parametrize("value", ["1e13", "1e9"])
def test_dpo_refuses_a_timeout_the_clocks_cannot_hold(value, monkeypatch, capsys):
    from megatron_prune.dpo import __main__ as dpo

    code, err = _launch(dpo, ["--model-preset", "tiny", "--data-path", str(SAMPLE), "--device", "cpu", "--dry-run",
                              "--distributed-timeout-minutes", value], monkeypatch, capsys)
    assert code == 2
    assert f"--distributed-timeout-minutes must be at most 10000000 (about 19 years), got {float(value)}" in err
    assert "Traceback" not in err


def test_grpo_refuses_it_too(monkeypatch, capsys):
    from megatron_prune.grpo import __main__ as grpo

    code, err = _launch(grpo, ["--model-preset", "tiny", "--task", "toy", "--device", "cpu", "--dry-run",
                               "--distributed-timeout-minutes", "1e13"], monkeypatch, capsys)
    assert code == 2
    assert "--distributed-timeout-minutes must be at most 10000000" in err


def test_a_long_but_holdable_timeout_is_kept():
    from megatron_prune.config import TrainConfig

    assert TrainConfig(distributed_timeout_minutes=1e7).distributed_timeout_minutes == 1e7
    assert TrainConfig(distributed_timeout_minutes=0.5).distributed_timeout_minutes == 0.5
