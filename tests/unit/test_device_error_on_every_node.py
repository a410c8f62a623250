"""A device that cannot start (no torch_npu, no NPU visible, a broken MindSpeed) is said like a
usage error: by the first rank of every node, handed to torchrun's failure report, exit code 2."""

from __future__ import annotations

import json

import pytest


@pytest.mark.parametrize("rank, local_rank, speaks", [("8", "0", True), ("9", "1", False)])
def test_a_device_error_on_another_node_is_said_there(rank, local_rank, speaks, monkeypatch, capsys, tmp_path):
    from megatron_prune import arguments
    from megatron_prune.dpo.__main__ import main

    started = []
    monkeypatch.setattr(arguments.subprocess, "Popen", lambda *a, **k: started.append(a))
    monkeypatch.setattr(arguments.time, "sleep", lambda seconds: None)
    monkeypatch.setitem(__import__("sys").modules, "torch_npu", None)  # this host has no Ascend stack
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    with pytest.raises(SystemExit) as exc:
        main(["--device", "npu", "--model-preset", "tiny", "--dry-run"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    if speaks:
        assert err.startswith("megatron-prune: error: ") and "npu" in err.lower(), err
        assert json.loads(error_file.read_text())["message"]["message"] == err.strip()
    else:
        assert err == "" and not error_file.exists()
