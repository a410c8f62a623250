"""LoRA export refusals found before anything is written: output directories that overlap, and
a recorded (or given) HF base directory without its weights.

The checkpoints here are meta.json files only (what ``resolve_base`` reads); the exports
themselves are tested in tests/distributed/test_lora.py and tests/e2e/test_lora_cli.py.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys

import pytest

from megatron_prune.model.lora_base import hf_base, resolve_base
from tests.unit.model.hf_models import make_hf_model
from tests.unit.test_lora_base import _lora_checkpoint


def _tool():
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "tools")))
    import convert_megatron_to_hf

    return convert_megatron_to_hf


@pytest.mark.parametrize("inner", ["hf", "peft"])
def test_one_output_inside_the_other_is_refused(tmp_path, capsys, inner):
    """The second export would find the first one's files in its directory (refused after the
    first was written), or write into the first one's directory: refused before either is written."""
    outer = str(tmp_path / "out")
    nested = os.path.join(outer, "inner") + "/"
    hf_out, peft_out = (nested, outer) if inner == "hf" else (outer, nested)
    with pytest.raises(SystemExit) as exc:
        _tool().parse_args(["--load", str(tmp_path / "ckpt"), "--hf-out", hf_out, "--merge-lora",
                            "--peft-out", peft_out])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--hf-out and --peft-out must be different directories" in err, err
    assert "inside" in err, err
    assert not os.path.exists(outer)


def test_sibling_outputs_with_a_common_name_prefix_are_accepted(tmp_path):
    args = _tool().parse_args(["--load", str(tmp_path / "ckpt"), "--hf-out", str(tmp_path / "out"),
                               "--merge-lora", "--peft-out", str(tmp_path / "out-peft")])
    assert args.hf_out.endswith("out") and args.peft_out.endswith("out-peft")


@pytest.fixture()
def base_without_weights(tmp_path):
    """A LoRA checkpoint recording an HF base whose weight files have since been deleted (its
    config.json left behind), and an intact copy of that base."""
    hf = make_hf_model("qwen2", str(tmp_path / "hf"), seed=1)
    intact = str(shutil.copytree(hf, tmp_path / "intact"))
    ckpt = _lora_checkpoint(tmp_path / "ckpt", hf_base(hf).to_dict())
    for path in glob.glob(os.path.join(hf, "*.safetensors*")):
        os.remove(path)
    record = json.load(open(os.path.join(ckpt, "meta.json")))["lora_base"]
    return dict(hf=hf, intact=intact, ckpt=ckpt, record=record)


def test_recorded_base_without_weights_names_the_base_and_the_flag(base_without_weights):
    b = base_without_weights
    with pytest.raises(ValueError) as err:
        resolve_base(b["record"], ckpt=b["ckpt"], override=None, flag="--base-hf")
    message = str(err.value)
    assert message.startswith(b["ckpt"]) and b["hf"] in message and "--base-hf DIR" in message, message
    # The intact copy given with the flag puts it right.
    assert resolve_base(b["record"], ckpt=b["ckpt"], override=b["intact"], flag="--base-hf").path == b["intact"]


def test_given_base_without_weights_names_the_flag(base_without_weights):
    b = base_without_weights
    with pytest.raises(ValueError) as err:
        resolve_base(b["record"], ckpt=b["ckpt"], override=b["hf"], flag="--hf-model")
    assert str(err.value).startswith(f"--hf-model {b['hf']}: "), str(err.value)
