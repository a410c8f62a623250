"""Atomic checkpoint publication: a kill at any point of a save leaves the previous one loadable.

``save_checkpoint`` writes ``iter_XXXXXXX.tmp``, writes ``meta.json`` last, renames the directory
into place and only then replaces the tracker file. These tests crash a real
``save_checkpoint`` call at each of those points (the sharded write itself is replaced by a stub,
so no model or process group is needed) and check that ``find_latest`` / ``read_meta`` pick the
last complete checkpoint and say which one they fell back from.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from megatron_prune.model.arch import get_preset
from megatron_prune.training import checkpoint as ckpt

ARCH = get_preset("tiny")


class Killed(BaseException):
    """Stands in for SIGKILL: nothing after the raise point runs, no cleanup handler catches it."""


@pytest.fixture
def stub_io(monkeypatch):
    """Replace the sharded write with a file write; no RNG tracker needed."""
    from megatron.core import dist_checkpointing

    def fake_save(state, path):
        for name in ("shard_0.distcp", ".metadata"):
            with open(os.path.join(path, name), "w") as f:
                f.write("x")

    monkeypatch.setattr(dist_checkpointing, "save", fake_save)
    monkeypatch.setattr(ckpt, "_rng_tracker_states", lambda: {})
    return monkeypatch


def _save(root, iteration):
    return ckpt.save_checkpoint(str(root), iteration=iteration, model=[], arch=ARCH,
                                trainer_state={"objective": {"step": iteration}})


def test_a_checkpoint_of_another_format_is_refused(tmp_path, stub_io):
    """A directory another tool (or a later format) wrote is named, not read as ours."""
    final = _save(tmp_path, 2)
    meta_path = os.path.join(final, ckpt.META)
    with open(meta_path, encoding="utf-8") as f:
        meta = json.load(f)
    with open(meta_path, "w", encoding="utf-8") as f:
        json.dump({**meta, "format": "megatron-prune/2"}, f)
    with pytest.raises(ckpt.CheckpointError, match=r"unknown checkpoint format 'megatron-prune/2' \(expected megatron-prune/1\)"):
        ckpt.read_meta(str(tmp_path))


def _tracker(root):
    return (root / ckpt.TRACKER).read_text().strip()


def test_complete_saves_are_published_with_tracker(tmp_path, stub_io):
    _save(tmp_path, 2)
    final = _save(tmp_path, 4)
    assert final == str(tmp_path / "iter_0000004")
    assert _tracker(tmp_path) == "4"
    assert not list(tmp_path.glob("*.tmp"))
    meta = ckpt.read_meta(str(tmp_path))
    assert meta["path"] == final and meta["iteration"] == 4 and meta["arch"] == ARCH.to_dict()


def test_kill_during_shard_write_keeps_previous(tmp_path, stub_io):
    _save(tmp_path, 2)

    def dies_midway(state, path):
        with open(os.path.join(path, "shard_0.distcp"), "w") as f:
            f.write("partial")
        raise Killed

    from megatron.core import dist_checkpointing

    stub_io.setattr(dist_checkpointing, "save", dies_midway)
    with pytest.raises(Killed):
        _save(tmp_path, 4)
    assert (tmp_path / "iter_0000004.tmp").is_dir()
    assert not (tmp_path / "iter_0000004").exists()
    assert _tracker(tmp_path) == "2"
    assert ckpt.find_latest(str(tmp_path)) == str(tmp_path / "iter_0000002")
    assert ckpt.read_meta(str(tmp_path))["iteration"] == 2


def test_kill_before_meta_is_written_keeps_previous(tmp_path, stub_io):
    _save(tmp_path, 2)
    real_dump = json.dump

    def dies_in_meta(*args, **kwargs):
        raise Killed

    stub_io.setattr(json, "dump", dies_in_meta)
    with pytest.raises(Killed):
        _save(tmp_path, 4)
    stub_io.setattr(json, "dump", real_dump)
    assert ckpt.read_meta(str(tmp_path))["path"] == str(tmp_path / "iter_0000002")


def test_kill_between_rename_and_tracker_keeps_a_complete_one(tmp_path, stub_io):
    """The directory is in place but the tracker still names the previous save: both are
    complete; the tracker is the authority, so the published one (2) is loaded."""
    _save(tmp_path, 2)
    real_replace = os.replace

    def dies_on_tracker(src, dst):
        if str(dst).endswith(ckpt.TRACKER):
            raise Killed
        return real_replace(src, dst)

    stub_io.setattr(os, "replace", dies_on_tracker)
    with pytest.raises(Killed):
        _save(tmp_path, 4)
    stub_io.setattr(os, "replace", real_replace)
    assert (tmp_path / "iter_0000004" / ckpt.META).is_file()
    assert ckpt.find_latest(str(tmp_path)) == str(tmp_path / "iter_0000002")


@pytest.mark.parametrize("removed", [ckpt.META, "trainer_state.pt", os.path.join("dist", ".metadata")])
def test_tracker_naming_incomplete_dir_falls_back_and_says_so(tmp_path, stub_io, caplog, removed):
    """E.g. a checkpoint copied or deleted by hand (a partial rsync): the tracker names a directory
    without one of the files a save writes. The newest complete one is used, with one warning
    naming the incomplete one and what it lacks, however often the checkpoint is read."""
    _save(tmp_path, 2)
    _save(tmp_path, 4)
    os.remove(tmp_path / "iter_0000004" / removed)
    (tmp_path / "iter_0000006.tmp" / "dist").mkdir(parents=True)  # a save killed mid-way
    with caplog.at_level(logging.WARNING, logger=ckpt.__name__):
        for _ in range(6):  # a run reads the metadata several times (architecture, tokenizer, reference, load)
            meta = ckpt.read_meta(str(tmp_path))
    assert meta["path"] == str(tmp_path / "iter_0000002") and meta["iteration"] == 2
    assert [r.getMessage() for r in caplog.records] == [
        f"{tmp_path / ckpt.TRACKER} names {tmp_path / 'iter_0000004'}, which is incomplete (missing {removed}); "
        f"using {tmp_path / 'iter_0000002'}"]


def test_newest_dir_incomplete_without_tracker_is_named(tmp_path, stub_io, caplog):
    _save(tmp_path, 2)
    _save(tmp_path, 4)
    os.remove(tmp_path / ckpt.TRACKER)
    os.remove(tmp_path / "iter_0000004" / "trainer_state.pt")
    with caplog.at_level(logging.WARNING, logger=ckpt.__name__):
        assert ckpt.find_latest(str(tmp_path)) == str(tmp_path / "iter_0000002")
    assert f"{tmp_path / 'iter_0000004'} is incomplete (missing trainer_state.pt)" in caplog.text


def test_only_a_killed_first_save_is_named(tmp_path, stub_io):
    """A kill during the first save leaves only a .tmp: the error says so (and a partial copy says what it lacks)."""
    (tmp_path / "iter_0000002.tmp" / "dist").mkdir(parents=True)
    with pytest.raises(ckpt.CheckpointError) as exc:
        ckpt.find_latest(str(tmp_path))
    assert str(exc.value) == (f"--load {tmp_path}: no complete checkpoint found (expected iter_*/ holding meta.json, "
                              "trainer_state.pt, dist/.metadata); found only iter_0000002.tmp (a save that did not "
                              "finish)")
    _save(tmp_path / "copy", 4)
    os.remove(tmp_path / "copy" / "iter_0000004" / "trainer_state.pt")
    with pytest.raises(ckpt.CheckpointError, match=r"found only iter_0000004 \(missing trainer_state.pt\)"):
        ckpt.find_latest(str(tmp_path / "copy"))
    with pytest.raises(ckpt.CheckpointError, match=r"iter_0000004: incomplete checkpoint \(missing trainer_state.pt\)"):
        ckpt.find_latest(str(tmp_path / "copy" / "iter_0000004"))


def test_no_tracker_scans_for_newest_complete(tmp_path, stub_io):
    _save(tmp_path, 2)
    _save(tmp_path, 10)
    os.remove(tmp_path / ckpt.TRACKER)
    (tmp_path / "iter_0000012.tmp" / "dist").mkdir(parents=True)
    assert ckpt.find_latest(str(tmp_path)) == str(tmp_path / "iter_0000010")


def test_explicit_iteration_dir_and_errors(tmp_path, stub_io):
    _save(tmp_path, 2)
    assert ckpt.find_latest(str(tmp_path / "iter_0000002")) == str(tmp_path / "iter_0000002")
    with pytest.raises(ckpt.CheckpointError, match="does not exist"):
        ckpt.find_latest(str(tmp_path / "nope"))
    empty = tmp_path / "empty"
    (empty / "iter_0000002.tmp" / "dist").mkdir(parents=True)
    with pytest.raises(ckpt.CheckpointError, match="no complete checkpoint"):
        ckpt.find_latest(str(empty))


def test_retry_after_a_killed_save_replaces_the_leftover(tmp_path, stub_io):
    """A resumed run saving the same iteration again clears the stale .tmp first."""
    (tmp_path / "iter_0000004.tmp" / "dist").mkdir(parents=True)
    (tmp_path / "iter_0000004.tmp" / "dist" / "stale").write_text("old")
    _save(tmp_path, 4)
    assert not (tmp_path / "iter_0000004.tmp").exists()
    assert not (tmp_path / "iter_0000004" / "dist" / "stale").exists()
    assert ckpt.read_meta(str(tmp_path))["iteration"] == 4


@pytest.mark.parametrize("killed_at", ["publish", "delete"])
def test_resaving_an_iteration_never_leaves_a_partial_checkpoint_in_place(tmp_path, stub_io, killed_at):
    """A re-save of an existing iteration (a launch that goes back: --load X/iter_2 --save X) moves
    the old directory aside before deleting it. Killed before the new one is in place, the run
    falls back to the newest complete checkpoint; killed while deleting the old one, the new one is
    complete. Deleting in place, a kill could leave meta.json and the index without the shards."""
    import shutil

    _save(tmp_path, 2)
    _save(tmp_path, 4)
    real_replace, real_rmtree = os.replace, shutil.rmtree

    def dies_publishing(src, dst):
        if str(src).endswith(".tmp") and str(dst).endswith("iter_0000004"):
            raise Killed
        return real_replace(src, dst)

    def dies_deleting(path, *args, **kwargs):
        if str(path).endswith(".old") and os.path.exists(path):
            real_rmtree(os.path.join(path, "dist"))  # half deleted
            raise Killed
        return real_rmtree(path, *args, **kwargs)

    if killed_at == "publish":
        stub_io.setattr(os, "replace", dies_publishing)
    else:
        stub_io.setattr(shutil, "rmtree", dies_deleting)
    with pytest.raises(Killed):
        _save(tmp_path, 4)
    stub_io.setattr(os, "replace", real_replace)
    stub_io.setattr(shutil, "rmtree", real_rmtree)
    expected = "iter_0000002" if killed_at == "publish" else "iter_0000004"
    assert ckpt.find_latest(str(tmp_path)) == str(tmp_path / expected)
    assert (tmp_path / "iter_0000004.old").is_dir()
    _save(tmp_path, 4)  # the next save of that iteration clears what was left
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("iter_")) == ["iter_0000002", "iter_0000004"]


# --------------------------------------------------------------------------- --save / --load of one launch


def test_save_and_load_of_one_directory_start_fresh_until_it_holds_a_checkpoint(tmp_path, stub_io, capsys,
                                                                                 monkeypatch):
    """``--save X --load X`` on the first launch (X missing, empty, or only a killed first save in it)
    starts fresh with a notice, however the two flags spell X (``x``, ``./x``, ``x/``, its absolute
    path); once X holds a checkpoint, it resumes it."""
    x = str(tmp_path / "x")
    assert ckpt.resume_source(x, x, can_start_fresh=True) is None
    assert capsys.readouterr().out == (f"[megatron-prune] --load {x} holds no complete checkpoint yet: starting a new "
                                       f"run at iteration 0 that saves into --save {x}\n")
    monkeypatch.chdir(tmp_path)
    spellings = ["./x", "x/", x]
    for load in spellings:
        assert ckpt.resume_source("x", load, can_start_fresh=True) is None, load
        assert capsys.readouterr().out == (f"[megatron-prune] --load {load} holds no complete checkpoint yet: starting "
                                           "a new run at iteration 0 that saves into --save x\n")
    (tmp_path / "x" / "iter_0000002.tmp" / "dist").mkdir(parents=True)
    assert ckpt.resume_source(x, x, can_start_fresh=True) is None
    assert "found only iter_0000002.tmp (a save that did not finish)" in capsys.readouterr().out
    for load in spellings:
        assert ckpt.resume_source("x", load, can_start_fresh=True) is None, load
        assert "found only iter_0000002.tmp (a save that did not finish)" in capsys.readouterr().out
    _save(x, 2)
    assert ckpt.resume_source(x, x, can_start_fresh=True) == x
    for load in spellings:
        assert ckpt.resume_source("x", load, can_start_fresh=True) == load
    assert capsys.readouterr().out == ""


def test_load_of_a_checkpoint_inside_the_save_directory_resumes_it(tmp_path, stub_io):
    """``--save X --load X/iter_N`` resumes an earlier checkpoint of the same run (X's later saves
    go on in X); a --load from anywhere else into an X that holds checkpoints is refused, a sibling
    whose name starts with X's included: its saves would land among X's."""
    x = str(tmp_path / "x")
    _save(x, 2)
    _save(x, 4)
    earlier = os.path.join(x, "iter_0000002")
    assert ckpt.resume_source(x, earlier, can_start_fresh=True) == earlier
    assert ckpt.resume_source(x + "/", earlier, can_start_fresh=True) == earlier
    for other in (str(tmp_path / "y"), str(tmp_path / "x_other")):
        _save(other, 2)
        with pytest.raises(ckpt.CheckpointError) as exc:
            ckpt.resume_source(x, other, can_start_fresh=True)
        assert str(exc.value) == (f"--save {x} already holds checkpoints (newest: {x}/iter_0000004) that this run from "
                                  f"--load {other} would overwrite; choose another --save")


def test_load_that_is_not_the_save_directory_must_exist(tmp_path, stub_io):
    """Only the --save directory itself may be empty: another --load is what the run starts from."""
    x, y = str(tmp_path / "x"), str(tmp_path / "y")
    assert ckpt.resume_source(x, y, can_start_fresh=True) == y  # find_latest then says "does not exist"
    with pytest.raises(ckpt.CheckpointError, match="does not exist"):
        ckpt.find_latest(y)
    with pytest.raises(ckpt.CheckpointError) as exc:  # no model to start from but the checkpoint
        ckpt.resume_source(x, x, can_start_fresh=False)
    assert str(exc.value) == (f"--load {x}: directory does not exist; a first run into --save {x} needs "
                              "--model-preset or --hf-model to start from")


def test_save_holding_checkpoints_without_load_is_refused(tmp_path, stub_io):
    """Rerunning a killed run's command without --load would start at iteration 0 and overwrite its checkpoints."""
    x = str(tmp_path / "x")
    assert ckpt.resume_source(x, None, can_start_fresh=True) is None
    (tmp_path / "x" / "iter_0000002.tmp" / "dist").mkdir(parents=True)  # nothing complete yet: nothing lost
    assert ckpt.resume_source(x, None, can_start_fresh=True) is None
    _save(x, 2)
    _save(x, 4)
    with pytest.raises(ckpt.CheckpointError) as exc:
        ckpt.resume_source(x, None, can_start_fresh=True)
    assert str(exc.value) == (f"--save {x} already holds checkpoints (newest: {x}/iter_0000004) that a new run "
                              f"would overwrite; pass --load {x} to resume from it, or choose another --save")


def test_only_rank_0_warns_and_gives_notice(tmp_path, stub_io, caplog, capsys, monkeypatch):
    """Before the process group starts every rank runs the checks: only torchrun's RANK 0 speaks."""
    monkeypatch.setenv("RANK", "1")
    _save(tmp_path / "x", 2)
    _save(tmp_path / "x", 4)
    os.remove(tmp_path / "x" / "iter_0000004" / "trainer_state.pt")
    with caplog.at_level(logging.WARNING, logger=ckpt.__name__):
        assert ckpt.find_latest(str(tmp_path / "x")) == str(tmp_path / "x" / "iter_0000002")
    assert ckpt.resume_source(str(tmp_path / "y"), str(tmp_path / "y"), can_start_fresh=True) is None
    assert caplog.text == "" and capsys.readouterr().out == ""


def _write_with(stub_io, before_write):
    """The stubbed sharded write, after ``before_write()`` (it runs where Megatron's writers would)."""
    from megatron.core import dist_checkpointing

    write = dist_checkpointing.save

    def save(state, path):
        before_write()
        write(state, path)

    stub_io.setattr(dist_checkpointing, "save", save)


def test_ctrl_c_during_a_save_is_held_until_it_is_published(tmp_path, stub_io):
    """A SIGINT inside the save: the save completes and is published, then KeyboardInterrupt."""
    import signal

    _save(tmp_path, 2)
    _write_with(stub_io, lambda: os.kill(os.getpid(), signal.SIGINT))
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 4)
    assert _tracker(tmp_path) == "4" and not list(tmp_path.glob("*.tmp"))
    assert ckpt.read_meta(str(tmp_path))["iteration"] == 4
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_second_ctrl_c_during_a_save_aborts_it(tmp_path, stub_io):
    import signal

    _save(tmp_path, 2)

    def twice():
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        raise AssertionError("the second SIGINT did not abort the save")

    _write_with(stub_io, twice)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 4)
    assert (tmp_path / "iter_0000004.tmp").is_dir() and _tracker(tmp_path) == "2"
    assert ckpt.find_latest(str(tmp_path)) == str(tmp_path / "iter_0000002")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_writer_process_forked_by_a_save_ignores_ctrl_c(tmp_path, stub_io):
    """Megatron's writers are forked from the saving process and share its process group: a
    Ctrl-C reaches them too, and each must still finish its part (a dead writer hangs the save)."""
    import signal

    done = tmp_path / "writer_done"

    def fork_a_writer():
        pid = os.fork()
        if pid == 0:
            try:
                os.kill(os.getpid(), signal.SIGINT)
                done.write_text("x")
            finally:
                os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0

    _write_with(stub_io, fork_a_writer)
    _save(tmp_path, 2)
    assert done.exists() and _tracker(tmp_path) == "2"


def test_ctrl_c_after_a_checkpoint_names_the_load_that_resumes(tmp_path, stub_io, capsys, monkeypatch):
    """The CLI's Ctrl-C line (exit 130): with a complete checkpoint in --save it names the --load
    that resumes (the run before the first checkpoint is covered end to end in test_user_paths)."""
    import megatron_prune.dpo.__main__ as dpo_main
    from tests.e2e.conftest import TINY_DPO

    _save(tmp_path / "ckpt", 2)

    def interrupted(configs, checked):
        raise KeyboardInterrupt

    monkeypatch.setattr(dpo_main, "_run", interrupted)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    code = dpo_main.main([*TINY_DPO, "--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err
    assert code == 130
    assert f"megatron-prune: interrupted; --load {tmp_path / 'ckpt'} resumes from its newest complete checkpoint" in err


# --- what a resume restores ---------------------------------------------------------------------


@pytest.fixture
def stub_load(stub_io):
    """Loading reads the stubbed shards back as an empty state (the model is ``[]``)."""
    from megatron.core import dist_checkpointing

    stub_io.setattr(dist_checkpointing, "load", lambda state, path, **kw: {})
    return stub_io


def test_resume_restores_the_rng_states_saved_with_the_checkpoint(tmp_path, stub_load):
    """After a resume, torch's RNG draws what it would have drawn right after the save, and Megatron's
    model-parallel RNG tracker gets the states it had then; without restore_rng neither is touched."""
    tracker_then = {"model-parallel-rng": torch.tensor([7, 8, 9])}
    stub_load.setattr(ckpt, "_rng_tracker_states", lambda: tracker_then)
    restored = []
    stub_load.setattr(ckpt, "_set_rng_tracker_states", restored.append)
    torch.manual_seed(1234)
    _save(tmp_path, 3)
    next_draws = torch.rand(8)  # what the uninterrupted run draws next
    torch.rand(100)  # the stopped run (or a new process) moves on

    ckpt.load_checkpoint(str(tmp_path), model=[], restore_rng=False)
    assert not restored and not torch.equal(torch.rand(8), next_draws)

    meta = ckpt.load_checkpoint(str(tmp_path), model=[], restore_rng=True)
    assert meta["trainer"] == {"objective": {"step": 3}}
    assert torch.equal(torch.rand(8), next_draws)
    assert len(restored) == 1 and torch.equal(restored[0]["model-parallel-rng"], tracker_then["model-parallel-rng"])


def test_rng_states_are_restored_only_at_the_layout_that_saved_them(tmp_path, stub_load):
    """Rank k of another layout of the same world size holds another part of the model: given the
    saved states, two TP ranks that were two DP ranks would draw different LoRA dropout masks on one
    input and their replicated adapters would drift apart. There the launch's own seeding stands."""
    restored = []
    stub_load.setattr(ckpt, "_set_rng_tracker_states", restored.append)
    dp2 = {"tp": 1, "pp": 1, "vpp": None, "dp": 2, "ep": 1, "cp": 1}
    stub_load.setattr(ckpt, "_rng_layout", lambda: dp2)
    _save(tmp_path, 3)
    stub_load.setattr(ckpt, "_rng_layout", lambda: {**dp2, "tp": 2, "dp": 1})
    ckpt.load_checkpoint(str(tmp_path), model=[], restore_rng=True)
    assert not restored
    stub_load.setattr(ckpt, "_rng_layout", lambda: dict(dp2))
    ckpt.load_checkpoint(str(tmp_path), model=[], restore_rng=True)
    assert len(restored) == 1


class _FakeDeviceRNG:
    """Stands in for ``torch.cuda``'s default generator (no GPU here): a state that draws move."""

    def __init__(self):
        self.state = torch.tensor([0], dtype=torch.uint8)

    def get_rng_state(self):
        return self.state.clone()

    def set_rng_state(self, state):
        self.state = state.clone()

    def draw(self):
        self.state += 1


def test_resume_restores_the_devices_own_generator(tmp_path, stub_load, monkeypatch):
    """On a GPU, draws outside Megatron's tracker forks (hidden dropout without sequence parallelism)
    come from the device's default generator, which every launch reseeds: the checkpoint keeps its state per rank and a resume on
    the same kind of device restores it; on another kind (CPU here) it is left alone."""
    from megatron_prune import accelerator

    device = _FakeDeviceRNG()
    gpu = type("FakeGPU", (), {"kind": "cuda", "module": device})()
    monkeypatch.setattr(accelerator, "get_accelerator", lambda: gpu)
    device.draw()
    _save(tmp_path, 3)
    saved = device.get_rng_state()
    device.draw()
    device.draw()
    ckpt.load_checkpoint(str(tmp_path), model=[], restore_rng=True)
    assert torch.equal(device.state, saved)

    device.draw()
    moved = device.get_rng_state()
    monkeypatch.setattr(accelerator, "get_accelerator", lambda: type("FakeNPU", (), {"kind": "npu", "module": device})())
    ckpt.load_checkpoint(str(tmp_path), model=[], restore_rng=True)
    assert torch.equal(device.state, moved)


def test_checkpoint_saved_without_an_optimizer_refuses_to_resume_one(tmp_path, stub_load):
    """A checkpoint saved without optimizer state says so, and loading it with an optimizer (a resume)
    is refused instead of starting the optimizer from nothing."""
    _save(tmp_path, 1)
    assert ckpt.read_meta(str(tmp_path))["has_optimizer"] is False
    with pytest.raises(ckpt.CheckpointError, match="has no optimizer state"):
        ckpt.load_checkpoint(str(tmp_path), model=[], optimizer=object())


def test_a_failed_shard_write_names_the_save_directory_and_the_cause(tmp_path, stub_io):
    """torch's CheckpointException is a BaseException: no handler caught it, and torchrun's report
    had no cause. Now the run stops with one line naming --save and the first rank's error."""
    import traceback

    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    _save(tmp_path, 2)

    def disk_full(state, path):
        error = OSError(28, "No space left on device")
        raise CheckpointException("save", {1: (error, traceback.StackSummary()), 0: (error, traceback.StackSummary())})

    stub_io.setattr(dist_checkpointing, "save", disk_full)
    with pytest.raises(ckpt.CheckpointError) as info:
        _save(tmp_path, 4)
    assert str(info.value) == (
        f"--save {tmp_path}: writing the checkpoint of iteration 4 into {tmp_path}/iter_0000004.tmp failed (OSError: "
        "[Errno 28] No space left on device (on rank 0; failed on ranks 0, 1)); the checkpoints published before it "
        "are intact")
    assert ckpt.read_meta(str(tmp_path))["iteration"] == 2


def test_a_disk_full_after_the_shards_names_the_save_directory(tmp_path, stub_io, caplog):
    """Rank 0's own files after the shards: torch's message for a full disk names no file
    ("unexpected pos 17088 vs 16976"). The run stops with the --save line instead. A failure to move
    the tracker after the checkpoint is published only warns: the checkpoint is complete."""
    _save(tmp_path, 2)
    real_save = torch.save

    def disk_full(obj, path, *args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 17088 vs 16976")

    stub_io.setattr(torch, "save", disk_full)
    with pytest.raises(ckpt.CheckpointError) as info:
        _save(tmp_path, 4)
    assert str(info.value).startswith(f"--save {tmp_path}: writing the checkpoint of iteration 4 into "
                                      f"{tmp_path}/iter_0000004.tmp failed (RuntimeError: [enforce fail")
    assert ckpt.read_meta(str(tmp_path))["iteration"] == 2

    stub_io.setattr(torch, "save", real_save)
    real_replace = os.replace

    def tracker_fails(src, dst):
        if os.path.basename(dst) == ckpt.TRACKER:
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    stub_io.setattr(os, "replace", tracker_fails)
    with caplog.at_level("WARNING"):
        assert _save(tmp_path, 6).endswith("iter_0000006")
    assert f"updating {ckpt.TRACKER} failed (OSError: [Errno 28] No space left on device)" in caplog.text
    assert _tracker(tmp_path) == "2" and os.path.isfile(tmp_path / "iter_0000006" / ckpt.META)


def test_converter_save_dir_left_by_a_killed_conversion_is_reused(tmp_path, stub_io):
    """tools/convert_hf_to_megatron.py's --save: a killed conversion's iter_*.tmp is no checkpoint
    (the next save replaces it); a complete checkpoint is refused."""
    from megatron_prune.model.hf_convert import check_save_dir

    (tmp_path / "iter_0000000.tmp" / "dist").mkdir(parents=True)
    check_save_dir(str(tmp_path))
    _save(tmp_path, 0)
    with pytest.raises(ValueError, match=r"already holds checkpoints \(iter_0000000\); choose a new directory"):
        check_save_dir(str(tmp_path))
