"""The recorded base of a LoRA checkpoint: fingerprint, and finding it again at --load / export.

The checkpoints here are meta.json files only (what ``check_load`` and ``resolve_base`` read);
loading adapters onto the rebuilt base is tested in tests/distributed/test_lora.py and through
the CLI in tests/e2e/test_lora_cli.py.
"""

from __future__ import annotations

import json
import os
import sys
import re
import shutil

import pytest

from megatron_prune.model.arch import get_preset
from megatron_prune.lora_config import LoRAConfig, check_load, lora_meta
from megatron_prune.model.lora_base import BaseSource, hf_base, hf_fingerprint, preset_base, resolve_base
from tests.unit.model.hf_models import make_hf_model

LORA = LoRAConfig(rank=4)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return make_hf_model("qwen2", str(tmp_path_factory.mktemp("base") / "hf"), seed=1)


def _lora_checkpoint(root, base: dict | None, lora: LoRAConfig = LORA) -> str:
    """A save directory whose one checkpoint's meta.json records ``base`` (no tensors needed here:
    the other files a checkpoint holds are empty stand-ins)."""
    from megatron_prune.training.checkpoint import FORMAT, META, TRACKER, iteration_dir

    arch = base["arch"] if base else preset_base("tiny", seed=0).arch
    ckpt = iteration_dir(str(root), 3)
    os.makedirs(os.path.join(ckpt, "dist"))
    for name in ("trainer_state.pt", os.path.join("dist", ".metadata")):
        open(os.path.join(ckpt, name), "wb").close()
    meta = {"format": FORMAT, "iteration": 3, "arch": arch, "has_optimizer": True, **lora_meta(lora, base=base)}
    with open(os.path.join(ckpt, META), "w") as f:
        json.dump(meta, f)
    with open(os.path.join(str(root), TRACKER), "w") as f:
        f.write("3")
    return ckpt


def test_fingerprint_ignores_location_and_sharding_but_not_weights(hf_dir, tmp_path):
    moved = shutil.copytree(hf_dir, tmp_path / "moved")
    resharded = make_hf_model("qwen2", str(tmp_path / "sharded"), seed=1, max_shard_size="40KB")
    assert os.path.isfile(os.path.join(resharded, "model.safetensors.index.json"))
    other = make_hf_model("qwen2", str(tmp_path / "other"), seed=2)
    fp = hf_fingerprint(hf_dir)
    assert fp.startswith("sha256:")
    assert hf_fingerprint(str(moved)) == fp
    assert hf_fingerprint(resharded) == fp
    assert hf_fingerprint(other) != fp


def test_starting_run_records_the_absolute_hf_path_or_the_preset(hf_dir, monkeypatch):
    monkeypatch.chdir(os.path.dirname(hf_dir))
    record = check_load(None, LORA, hf_model=os.path.basename(hf_dir))
    assert record["kind"] == "hf" and record["path"] == hf_dir and os.path.isabs(record["path"])
    assert record["fingerprint"] == hf_fingerprint(hf_dir) and record["arch"]["model_type"] == "qwen2"
    assert check_load(None, LORA, model_preset="tiny", seed=7) == preset_base("tiny", seed=7).to_dict()
    assert check_load(None, LoRAConfig(), hf_model=hf_dir) is None


def test_resume_finds_the_recorded_base_or_the_override(hf_dir, tmp_path):
    root = tmp_path / "ckpt"
    _lora_checkpoint(root, hf_base(hf_dir).to_dict())
    assert check_load(str(root), LORA) == hf_base(hf_dir).to_dict()
    copy = str(shutil.copytree(hf_dir, tmp_path / "copy"))
    assert check_load(str(root), LORA, hf_model=copy)["path"] == copy


def test_moved_base_is_one_clear_error_naming_the_path_and_the_flag(hf_dir, tmp_path):
    moved = str(shutil.copytree(hf_dir, tmp_path / "was_here"))
    root = tmp_path / "ckpt"
    ckpt = _lora_checkpoint(root, hf_base(moved).to_dict())
    shutil.rmtree(moved)
    with pytest.raises(ValueError) as err:
        check_load(str(root), LORA)
    assert moved in str(err.value) and "--hf-model DIR" in str(err.value) and "missing" in str(err.value)
    # Export names its own override flag.
    with pytest.raises(ValueError) as err:
        resolve_base(json.load(open(os.path.join(ckpt, "meta.json")))["lora_base"], ckpt=ckpt, override=None,
                     flag="--base-hf")
    assert moved in str(err.value) and "--base-hf DIR" in str(err.value)
    # The override puts it right.
    assert resolve_base(hf_base(hf_dir).to_dict(), ckpt=ckpt, override=hf_dir, flag="--base-hf").path == hf_dir


def test_base_of_another_architecture_or_with_other_weights_is_refused(hf_dir, tmp_path):
    ckpt = _lora_checkpoint(tmp_path / "ckpt", hf_base(hf_dir).to_dict())
    record = hf_base(hf_dir).to_dict()
    llama = make_hf_model("llama", str(tmp_path / "llama"), seed=1)
    with pytest.raises(ValueError, match=r"is a different model \(llama, .*model_type 'llama' \(not 'qwen2'\).* than the base"):
        resolve_base(record, ckpt=ckpt, override=llama, flag="--base-hf")
    retrained = make_hf_model("qwen2", str(tmp_path / "retrained"), seed=5)
    with pytest.raises(ValueError, match="holds other weights"):
        resolve_base(record, ckpt=ckpt, override=retrained, flag="--hf-model")
    with pytest.raises(ValueError, match="not an HF model directory"):
        resolve_base(record, ckpt=ckpt, override=str(tmp_path), flag="--hf-model")


def test_preset_base_takes_no_directory(hf_dir, tmp_path):
    _lora_checkpoint(tmp_path / "ckpt", preset_base("tiny", seed=0).to_dict())
    with pytest.raises(ValueError, match=r"^--base-hf \S+: the LoRA adapters of \S+ were trained on .*tiny.*, which "
                                         r"is rebuilt from its name and seed, not read from a directory; drop --base-hf"):
        resolve_base(preset_base("tiny", seed=0).to_dict(), ckpt=str(tmp_path / "ckpt"), override=hf_dir,
                     flag="--base-hf")


def test_preset_base_is_rebuilt_from_its_name_and_seed(tmp_path):
    record = preset_base("tiny", seed=11).to_dict()
    _lora_checkpoint(tmp_path / "ckpt", record)
    assert check_load(str(tmp_path / "ckpt"), LORA) == record
    assert check_load(str(tmp_path / "ckpt"), LORA, model_preset="tiny", seed=99) == record  # the recorded seed
    with pytest.raises(ValueError, match="not on the preset 'tiny-tied'"):
        check_load(str(tmp_path / "ckpt"), LORA, model_preset="tiny-tied")
    assert BaseSource.from_dict(record).describe() == "the preset 'tiny' (seed 11)"


def test_checkpoint_without_a_base_record_is_refused(tmp_path):
    _lora_checkpoint(tmp_path / "ckpt", None)
    with pytest.raises(ValueError, match="records no base model"):
        check_load(str(tmp_path / "ckpt"), LORA)


def _megatron_checkpoint(root, *, data: bytes) -> str:
    """A save directory of one checkpoint without adapters: meta.json and stand-in dist and trainer files."""
    from megatron_prune.training.checkpoint import FORMAT, META, iteration_dir

    ckpt = iteration_dir(str(root), 0)
    os.makedirs(os.path.join(ckpt, "dist"))
    open(os.path.join(ckpt, "trainer_state.pt"), "wb").close()
    meta = {"format": FORMAT, "iteration": 0, "arch": preset_base("tiny", seed=0).arch, "has_optimizer": False}
    with open(os.path.join(ckpt, META), "w") as f:
        json.dump(meta, f)
    for name, body in ((".metadata", b"layout"), ("__0_0.distcp", data), ("common.pt", os.urandom(8))):
        with open(os.path.join(ckpt, "dist", name), "wb") as f:
            f.write(body)
    return ckpt


def test_megatron_base_is_recorded_found_and_checked(tmp_path):
    data = bytes(range(256)) * 16
    base_ckpt = _megatron_checkpoint(tmp_path / "base", data=data)
    record = check_load(str(tmp_path / "base"), LORA)
    assert record["kind"] == "megatron" and record["path"] == base_ckpt
    with pytest.raises(ValueError, match="give either --load .* or --hf-model, not both"):
        check_load(str(tmp_path / "base"), LORA, hf_model="hf")
    # Location-independent (a copy has the same fingerprint); a changed middle byte is seen.
    copy = _megatron_checkpoint(tmp_path / "copy", data=data)
    assert check_load(str(tmp_path / "copy"), LORA)["fingerprint"] == record["fingerprint"]
    _lora_checkpoint(tmp_path / "lora", record)
    assert check_load(str(tmp_path / "lora"), LORA) == record
    with pytest.raises(ValueError, match="--hf-model cannot replace a Megatron base"):
        check_load(str(tmp_path / "lora"), LORA, hf_model=str(tmp_path))
    changed = bytearray(data)
    changed[len(data) // 2] ^= 1
    with open(os.path.join(base_ckpt, "dist", "__0_0.distcp"), "wb") as f:
        f.write(changed)
    with pytest.raises(ValueError, match="holds other weights"):
        check_load(str(tmp_path / "lora"), LORA)
    shutil.rmtree(tmp_path / "base")
    with pytest.raises(ValueError, match=f"{base_ckpt}, is missing .*symbolic link"):
        check_load(str(tmp_path / "lora"), LORA)
    assert os.path.isdir(copy)


def test_reference_of_a_lora_run_started_from_a_training_checkpoint_is_that_checkpoint(tmp_path):
    """The reference a DPO/GRPO run loads (session.reference_source): a full-parameter training
    checkpoint records the reference it was trained against; a LoRA run started from it compares
    with its own base (the checkpoint's weights, loaded through the base record), and resuming that
    LoRA run keeps it."""
    from megatron_prune.config import CheckpointConfig, ModelConfig
    from megatron_prune.training.session import UsageError, reference_source

    trained = _lora_checkpoint(tmp_path / "full", None)  # no "lora" entry: a full-parameter checkpoint
    with open(os.path.join(trained, "meta.json")) as f:
        meta = json.load(f)
    meta.pop("lora", None)
    original = str(tmp_path / "original" / "iter_0000000")
    meta["reference_load"] = original
    with open(os.path.join(trained, "meta.json"), "w") as f:
        json.dump(meta, f)
    model, load = ModelConfig(model_preset=None), CheckpointConfig(load=str(tmp_path / "full"))
    base = {"kind": "megatron", "path": trained}
    # Moved since: named as the recorded reference, not as a --load the user never gave.
    with pytest.raises(UsageError, match=rf"^--load \S+ records its reference model as {re.escape(original)}, "
                                         r"which no longer exists; pass --ref-load with where that checkpoint is now$"):
        reference_source(model, load, None)
    os.makedirs(original)
    assert reference_source(model, load, None) == original  # full-parameter resume
    assert reference_source(model, load, None, lora_base=base) is None  # LoRA start: its base
    lora_ckpt = _lora_checkpoint(tmp_path / "lora", preset_base("tiny", seed=0).to_dict())
    with open(os.path.join(lora_ckpt, "meta.json")) as f:
        meta = json.load(f)
    meta["reference_load"] = None  # what the LoRA start recorded
    with open(os.path.join(lora_ckpt, "meta.json"), "w") as f:
        json.dump(meta, f)
    assert reference_source(model, CheckpointConfig(load=str(tmp_path / "lora")), None, lora_base=base) is None


def test_a_reference_named_by_its_save_folder_is_recorded_as_one_checkpoint(tmp_path):
    """--finetune from a save folder, or --ref-load of one, names the folder's newest checkpoint:
    the reference is that checkpoint, recorded by its own path. Recorded as the folder, a resumed
    run took whatever that run had saved since as its reference (silently other losses)."""
    from megatron_prune.config import CheckpointConfig, ModelConfig
    from megatron_prune.training.session import reference_source

    first = _lora_checkpoint(tmp_path / "run", None)
    with open(os.path.join(first, "meta.json")) as f:
        meta = json.load(f)
    meta.pop("lora", None)  # a full-parameter training checkpoint (iteration 3)
    with open(os.path.join(first, "meta.json"), "w") as f:
        json.dump(meta, f)
    model = ModelConfig(model_preset=None)
    finetune = CheckpointConfig(load=str(tmp_path / "run"), finetune=True)
    assert reference_source(model, finetune, None) == os.path.abspath(first)
    assert reference_source(model, CheckpointConfig(), str(tmp_path / "run")) == os.path.abspath(first)


def test_moved_megatron_base_is_found_with_base_load(tmp_path):
    """A LoRA checkpoint whose Megatron base has moved resumes with --base-load NEW (same weights:
    the new place is what later checkpoints record); other weights, a non-checkpoint, and
    --base-load where it names nothing to replace are refused with the flag in the message."""
    data = bytes(range(256)) * 16
    base_ckpt = _megatron_checkpoint(tmp_path / "base", data=data)
    record = check_load(str(tmp_path / "base"), LORA)
    _lora_checkpoint(tmp_path / "lora", record)
    shutil.move(str(tmp_path / "base"), str(tmp_path / "moved"))
    with pytest.raises(ValueError, match=f"{base_ckpt}, is missing .*--base-load DIR"):
        check_load(str(tmp_path / "lora"), LORA)
    moved = LoRAConfig(rank=4, base_load=str(tmp_path / "moved"))
    found = check_load(str(tmp_path / "lora"), moved)
    assert found["path"] == os.path.join(str(tmp_path / "moved"), os.path.basename(base_ckpt))
    assert {k: v for k, v in found.items() if k != "path"} == {k: v for k, v in record.items() if k != "path"}
    # one iter_* directory works as well as the save root
    assert check_load(str(tmp_path / "lora"), LoRAConfig(rank=4, base_load=found["path"])) == found
    other = _megatron_checkpoint(tmp_path / "other", data=data[::-1])
    with pytest.raises(ValueError, match="--base-load .*other.* holds other weights .*pass the original base with "
                                         "--base-load DIR"):
        check_load(str(tmp_path / "lora"), LoRAConfig(rank=4, base_load=other))
    with pytest.raises(ValueError, match="--base-load .*nowhere: directory does not exist"):
        check_load(str(tmp_path / "lora"), LoRAConfig(rank=4, base_load=str(tmp_path / "nowhere")))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(ValueError, match="--base-load .*empty: holds no complete Megatron checkpoint"):
        check_load(str(tmp_path / "lora"), LoRAConfig(rank=4, base_load=str(tmp_path / "empty")))
    with pytest.raises(ValueError, match="--hf-model cannot replace a Megatron base.*--base-load DIR"):
        check_load(str(tmp_path / "lora"), LORA, hf_model=str(tmp_path))
    # Nothing to replace: starting LoRA, a full-parameter run, or a checkpoint without adapters.
    with pytest.raises(ValueError, match="--base-load replaces the recorded base"):
        check_load(None, moved)
    with pytest.raises(ValueError, match="--base-load .* needs --lora-rank > 0"):
        check_load(str(tmp_path / "lora"), LoRAConfig(rank=0, base_load=str(tmp_path / "moved")))
    with pytest.raises(ValueError, match="holds no LoRA adapters, so it is itself the base .* drop --base-load"):
        check_load(str(tmp_path / "moved"), moved)


def test_base_load_refused_for_an_hf_or_preset_base(hf_dir, tmp_path):
    _lora_checkpoint(tmp_path / "hf_lora", hf_base(hf_dir).to_dict())
    with pytest.raises(ValueError, match="--base-load: the LoRA adapters .* not on a Megatron checkpoint; drop "
                                         "--base-load \\(a moved HF base is given with --hf-model DIR\\)"):
        check_load(str(tmp_path / "hf_lora"), LoRAConfig(rank=4, base_load=str(tmp_path)))
    _lora_checkpoint(tmp_path / "preset_lora", preset_base("tiny", seed=0).to_dict())
    with pytest.raises(ValueError, match="not on a Megatron checkpoint; drop --base-load$"):
        check_load(str(tmp_path / "preset_lora"), LoRAConfig(rank=4, base_load=str(tmp_path)))


def test_compare_tool_refuses_a_lora_checkpoint_with_the_way_to_compare_it(tmp_path):
    """tools/compare_hf_megatron.py compares whole models: a LoRA checkpoint (adapters only) is
    refused with the export that makes it comparable, not with flags the tool does not have."""
    from megatron_prune.model.hf_convert import compare_hf_and_megatron
    from megatron_prune.model.provider import ParallelConfig

    _lora_checkpoint(tmp_path / "lora", preset_base("tiny", seed=0).to_dict())
    with pytest.raises(ValueError, match="holds LoRA adapters, not a whole model; export it with "
                                         "tools/convert_megatron_to_hf.py --load CKPT --hf-out DIR --merge-lora"):
        compare_hf_and_megatron(hf_dir=str(tmp_path / "hf"), load_dir=str(tmp_path / "lora"),
                                parallel=ParallelConfig(), seq_length=8, batch_size=1, seed=0, hf_device="cpu")


def test_resume_takes_the_trained_alpha_and_refuses_another(tmp_path):
    """alpha / r scales what the adapters learned: a resume without --lora-alpha runs at the
    checkpoint's alpha (not the default alpha = r), another alpha is refused, and the same set of
    targets in another order is the same adapters."""
    record = preset_base("tiny", seed=0).to_dict()
    trained = LoRAConfig(rank=4, alpha=8.0, dropout=0.1, targets="linear_qkv,linear_fc2")
    _lora_checkpoint(tmp_path / "ckpt", record, lora=trained)
    resumed = LoRAConfig(rank=4, targets="linear_fc2,linear_qkv")
    assert check_load(str(tmp_path / "ckpt"), resumed) == record
    assert resumed.alpha == 8.0 and resumed.scale == 2.0
    assert lora_meta(resumed)["lora"]["alpha"] == 8.0  # what its own checkpoints record
    assert check_load(str(tmp_path / "ckpt"), LoRAConfig(rank=4, alpha=8.0, targets=trained.targets)) == record
    with pytest.raises(ValueError, match=r"^--lora-alpha 4: --load \S+ holds adapters trained at --lora-alpha 8 "
                                         r"\(scale 2\), and another alpha would rescale them; leave --lora-alpha out"):
        check_load(str(tmp_path / "ckpt"), LoRAConfig(rank=4, alpha=4.0, targets=trained.targets))
    with pytest.raises(ValueError, match="holds LoRA adapters of rank 4 on linear_qkv,linear_fc2, but the flags ask"):
        check_load(str(tmp_path / "ckpt"), LoRAConfig(rank=4, targets="linear_qkv"))


def test_reference_checkpoint_makes_online_the_lora_default():
    from megatron_prune.lora_config import resolve_ref_mode

    assert resolve_ref_mode(None, LORA) == "adapter-off"
    assert resolve_ref_mode(None, LORA, ref_load="ref") == "online"
    assert resolve_ref_mode("precomputed", LORA, ref_load="ref") == "precomputed"
    with pytest.raises(ValueError, match="--ref-mode adapter-off uses the policy's own base weights"):
        resolve_ref_mode("adapter-off", LORA, ref_load="ref")


def test_lora_checkpoint_as_reference_is_refused_and_finetune_says_what_the_reference_is(tmp_path):
    from megatron_prune.config import CheckpointConfig
    from megatron_prune.training import session

    _lora_checkpoint(tmp_path / "lora", preset_base("tiny", seed=0).to_dict())
    with pytest.raises(session.UsageError, match=r"^--ref-load \S+ holds LoRA adapters \(rank 4\), not a whole "
                                                 r"model.*convert_megatron_to_hf.py --load \S+ --hf-out MERGED "
                                                 r"--merge-lora, then .*convert_hf_to_megatron.py"):
        session._check_full_weights(str(tmp_path / "lora"), get_preset("tiny"))
    notice = session.finetune_notice(CheckpointConfig(load=str(tmp_path / "lora"), finetune=True), None)
    assert "the reference is its base with the adapters off" in notice and "--merge-lora" in notice
    assert session.finetune_notice(CheckpointConfig(load=str(tmp_path / "lora")), None) is None
    assert session.finetune_notice(CheckpointConfig(load=str(tmp_path / "lora"), finetune=True), "ref") is None


def test_resume_with_another_copy_of_the_base_keeps_the_recorded_tokenizer(hf_dir, tmp_path):
    """--hf-model naming a copy of a LoRA run's base (its weights) does not replace the tokenizer
    the run recorded; it is the tokenizer only where the recorded one is gone."""
    from megatron_prune.config import CheckpointConfig, ModelConfig
    from megatron_prune.training import session

    ckpt = _lora_checkpoint(tmp_path / "ckpt", hf_base(hf_dir).to_dict())
    meta_path = os.path.join(ckpt, "meta.json")
    meta = json.load(open(meta_path))
    copy = str(shutil.copytree(hf_dir, tmp_path / "copy"))
    for recorded, expected in (("tiny", "tiny"), (hf_dir, hf_dir), (str(tmp_path / "gone"), copy)):
        json.dump({**meta, "tokenizer": recorded}, open(meta_path, "w"))
        got = session.resolve_tokenizer(ModelConfig(hf_model=copy), CheckpointConfig(load=str(tmp_path / "ckpt")))
        assert got == expected, (recorded, got)
    assert session.resolve_tokenizer(ModelConfig(hf_model=copy), CheckpointConfig()) == copy


def test_resume_from_an_iteration_folder_finds_the_run_s_own_tokenizer_copy(tmp_path):
    """The tokenizer the run recorded (a converted model's ``hf_assets``) has moved: ``--load`` of
    one iteration folder finds the copy the run keeps in its save folder; with no copy anywhere
    the error names the recorded path that is gone."""
    from megatron_prune.config import CheckpointConfig, ModelConfig
    from megatron_prune.training import session

    ckpt = _lora_checkpoint(tmp_path / "run", preset_base("tiny", seed=0).to_dict())
    meta_path = os.path.join(ckpt, "meta.json")
    gone = str(tmp_path / "converted" / "hf_assets")
    json.dump({**json.load(open(meta_path)), "tokenizer": gone}, open(meta_path, "w"))
    with pytest.raises(session.UsageError, match=rf"^cannot tell which tokenizer to use \(the checkpoint records "
                                                 rf"{re.escape(gone)}, which no longer exists\): pass --tokenizer$"):
        session.resolve_tokenizer(ModelConfig(), CheckpointConfig(load=ckpt))
    kept = tmp_path / "run" / "hf_assets"
    kept.mkdir()
    for load in (ckpt, str(tmp_path / "run")):
        assert session.resolve_tokenizer(ModelConfig(), CheckpointConfig(load=load)) == os.path.join(
            os.path.dirname(ckpt) if load == ckpt else load, "hf_assets")


def test_export_tool_refuses_what_it_cannot_write_before_writing_anything(tmp_path, capsys):
    """tools/convert_megatron_to_hf.py: flags of the HF directory without --hf-out, one directory for
    both outputs, and --peft-out of a checkpoint without adapters are refused before any file is written."""
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "tools")))
    import convert_megatron_to_hf as tool

    ckpt = _megatron_checkpoint(tmp_path / "full", data=os.urandom(64))
    hf_out, peft_out = str(tmp_path / "hf"), str(tmp_path / "peft")
    cases = {
        "--hf-assets applies to --hf-out DIR": ["--peft-out", peft_out, "--hf-assets", str(tmp_path)],
        "--max-shard-size applies to --hf-out DIR": ["--peft-out", peft_out, "--max-shard-size", "1KB"],
        "--hf-out and --peft-out must be different directories": ["--hf-out", hf_out, "--peft-out", hf_out],
        f"--peft-out: {ckpt} holds no LoRA adapters": ["--hf-out", hf_out, "--peft-out", peft_out],
    }
    for message, flags in cases.items():
        with pytest.raises(SystemExit) as exc:
            tool.main(["--load", ckpt, *flags])
        assert exc.value.code == 2 and message in capsys.readouterr().err, message
    assert not os.path.exists(hf_out) and not os.path.exists(peft_out)
