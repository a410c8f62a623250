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
        with open(os.path.join(path, "shard_0.distcp"), "w") as f:
            f.write("x")

    monkeypatch.setattr(dist_checkpointing, "save", fake_save)
    monkeypatch.setattr(ckpt, "_rng_tracker_states", lambda: {})
    return monkeypatch


def _save(root, iteration):
    return ckpt.save_checkpoint(str(root), iteration=iteration, model=[], arch=ARCH,
                                trainer_state={"objective": {"step": iteration}})


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


def test_tracker_naming_incomplete_dir_falls_back_and_says_so(tmp_path, stub_io, caplog):
    """E.g. a checkpoint copied or deleted by hand: the tracker names a directory without
    meta.json. The newest complete one is used, with a warning naming the incomplete one."""
    _save(tmp_path, 2)
    _save(tmp_path, 4)
    os.remove(tmp_path / "iter_0000004" / ckpt.META)
    (tmp_path / "iter_0000006.tmp" / "dist").mkdir(parents=True)  # a save killed mid-way
    with caplog.at_level(logging.WARNING, logger=ckpt.__name__):
        meta = ckpt.read_meta(str(tmp_path))
    assert meta["path"] == str(tmp_path / "iter_0000002") and meta["iteration"] == 2
    assert "iter_0000004" in caplog.text and "incomplete" in caplog.text


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
