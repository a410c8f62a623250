"""The patch registry: replaced, idempotent, off unless asked, reversible, helpful errors."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types

import pytest

from megatron_prune.patches import registry
from megatron_prune.patches.registry import Patch, PatchTargetError, rewrite_source


SCRATCH = '''
def make(n):
    """Doc."""
    return ["cuda"] * n


class K:
    def m(self):
        return "cuda"


class Sub(K):
    pass
'''


@pytest.fixture
def scratch(monkeypatch, tmp_path):
    """A throwaway module `megatron._mp_scratch` (a real file, so its source is readable) plus
    an alias module that imported its function by name."""
    path = tmp_path / "mp_scratch.py"
    path.write_text(SCRATCH)
    spec = importlib.util.spec_from_file_location("megatron._mp_scratch", path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "megatron._mp_scratch", mod)
    spec.loader.exec_module(mod)
    alias = types.ModuleType("megatron._mp_alias")
    alias.make = mod.make
    monkeypatch.setitem(sys.modules, "megatron._mp_alias", alias)
    monkeypatch.setattr(registry, "_REGISTRY", {})
    monkeypatch.setattr(registry, "_BY_TARGET", {})
    monkeypatch.setattr(registry, "_APPLIED", {})
    monkeypatch.setattr(registry, "_import_patch_modules", lambda: None)
    return mod, alias


def _wrap(original):
    def make(n):
        return ["cpu"] * n

    return make


def test_apply_replaces_target_and_aliases_then_reverts(scratch):
    mod, alias = scratch
    original = mod.make
    registry.register(Patch(name="t.make", target="megatron._mp_scratch.make", reason="test", build=_wrap, group="t"))
    assert mod.make(1) == ["cuda"], "nothing may change before an explicit apply"
    assert registry.apply_patches("t") == ["t.make"]
    assert mod.make(2) == ["cpu", "cpu"] and alias.make(1) == ["cpu"]
    assert mod.make.__wrapped__ is original and registry.is_applied("t.make")
    assert registry.apply_patches("t") == [], "applying twice is a no-op"
    assert registry.revert_patches("t") == ["t.make"]
    assert mod.make is original and alias.make is original


def test_other_groups_are_not_applied(scratch):
    mod, _ = scratch
    registry.register(Patch(name="t.make", target="megatron._mp_scratch.make", reason="x", build=_wrap, group="t"))
    registry.apply_patches("other")
    assert mod.make(1) == ["cuda"]


def test_registering_a_target_twice_is_an_error(scratch):
    registry.register(Patch(name="a", target="megatron._mp_scratch.make", reason="x", build=_wrap, group="t"))
    with pytest.raises(ValueError, match="already patched by 'a'"):
        registry.register(Patch(name="b", target="megatron._mp_scratch.make", reason="x", build=_wrap, group="t"))


def test_moved_target_names_symbol_and_version(scratch):
    registry.register(Patch(name="gone", target="megatron._mp_scratch.vanished", reason="x", build=_wrap,
                            group="t", checked_versions=("0.16.1",)))
    with pytest.raises(PatchTargetError, match=r"megatron\._mp_scratch\.vanished.*megatron-core"):
        registry.apply_patches("t")


def test_a_method_now_inherited_is_a_moved_target(scratch):
    """Patching the subclass would shadow the base's method (and a revert would leave the shadow)."""
    mod, _ = scratch
    registry.register(Patch(name="inherited", target="megatron._mp_scratch.Sub.m", reason="x", build=_wrap, group="t"))
    with pytest.raises(PatchTargetError, match=r"megatron\._mp_scratch\.Sub\.m is now inherited, not defined on Sub"):
        registry.apply_patches("t")
    assert "m" not in mod.Sub.__dict__ and mod.Sub().m() == "cuda"


def test_rewrite_source_function_and_method(scratch):
    mod, _ = scratch
    new = rewrite_source(('"cuda"', '"cpu"'))(mod.make)
    assert new(2) == ["cpu", "cpu"] and new.__doc__ == "Doc."
    method = rewrite_source(('"cuda"', '"cpu"'))(mod.K.__dict__["m"])
    assert method(mod.K()) == "cpu"


def test_rewrite_source_refuses_changed_text(scratch):
    mod, _ = scratch
    with pytest.raises(PatchTargetError, match="expected text .*not found"):
        rewrite_source(("device='cuda'", "device='cpu'"))(mod.make)


def test_every_cpu_patch_builds_against_installed_megatron():
    """Each registered CPU (and no-TE) patch resolves its target and its textual replacements still match."""
    from megatron_prune.patches import registered

    registry._import_patch_modules()
    patches = registered("cpu")
    assert len(patches) >= 20
    no_te = registered("no_te")
    assert len(no_te) == 2
    for patch in patches + no_te:
        _, _, original = registry._resolve(patch)
        patch.build(original)  # raises PatchTargetError naming the symbol if Megatron moved
        assert patch.reason and patch.checked_versions


def test_importing_the_plugin_patches_nothing():
    code = (
        "import megatron_prune, megatron_prune.patches as p, megatron_prune.model.provider;"
        "from megatron.core.transformer import utils;"
        "assert not hasattr(utils.get_default_causal_mask, '__megatron_prune_patch__');"
        "assert not p.registry._APPLIED; print('clean')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "clean" in out.stdout, out.stderr[-2000:]


def test_a_checkout_on_pythonpath_without_pip_install_finds_its_patches(tmp_path):
    """``PYTHONPATH=<checkout> python -m megatron_prune.dpo`` (no pip install) imports the
    top-level patches/ folder as megatron_prune.patches: a copy of the package and patches/,
    run with no site-packages finder for the project, loads the copy's registry."""
    import shutil

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    checkout = tmp_path / "checkout"
    for folder in ("megatron_prune", "patches"):
        # A link megatron_prune/patches -> patches (the mutation harness's copies have one) is left out:
        # the checkout must find patches/ by itself.
        skip = ("__pycache__", "samples", "tokenizer", *(("patches",) if folder == "megatron_prune" else ()))
        shutil.copytree(os.path.join(repo, folder), checkout / folder, ignore=shutil.ignore_patterns(*skip))
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]; "
            f"sys.path.insert(0, {str(checkout)!r}); import megatron_prune.patches.registry as r; print(r.__file__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(checkout / "patches" / "registry.py")


_MOE_FORWARD = """
import torch
import megatron_prune.patches as patches
from megatron_prune.model.arch import get_preset
from megatron_prune.model.provider import ParallelConfig, build_model_chunks
from megatron_prune.training.parallel import initialize_distributed, model_parallel

patches.apply_cpu_patches()
if {missing_te}:
    patches.apply_missing_te_patches()
patches.apply_cpu_patches = patches.apply_missing_te_patches = lambda: []  # as given, nothing more
initialize_distributed()
with model_parallel(ParallelConfig(), seed=1):
    (model,) = build_model_chunks(get_preset("tiny-moe"), ParallelConfig())
    try:
        print("shape", tuple(model(torch.randint(0, 100, (1, 16)), torch.arange(16)[None], None).shape))
    except NameError as exc:
        print("NameError", exc)
"""


@pytest.mark.parametrize("missing_te, expected", [(False, "NameError name 'te_general_gemm'"), (True, "shape (1, 16")])
def test_a_moe_router_without_transformer_engine_needs_the_no_te_patches_on_every_device(missing_te, expected):
    """Megatron 0.16 reads ``te_general_gemm`` in every MoE router forward and defines it only when
    Transformer Engine imports. The CPU patches (applied on CPU only) do not cover it, so a GPU
    without TE needs the ``no_te`` group, which ``initialize_distributed`` applies on every device."""
    code = _MOE_FORWARD.format(missing_te=missing_te)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert expected in out.stdout, (out.stdout + out.stderr)[-3000:]


_GPU_INIT = """
import types
import megatron_prune.training.parallel as parallel
from megatron_prune.patches import is_applied

gpu = types.SimpleNamespace(kind="cuda", set_device=lambda: None, process_group_backend="gloo")
parallel.get_accelerator = lambda: gpu
parallel.initialize_distributed()
print(is_applied("no_te.RouterGatingLinearFunction.forward"), is_applied("cpu.Router.gating"))
"""


def test_initialize_distributed_applies_the_no_te_patches_off_the_cpu_too():
    """On a (stand-in) GPU the CPU patches stay off and the no-TE ones go on (Megatron found no TE here)."""
    out = subprocess.run([sys.executable, "-c", _GPU_INIT], capture_output=True, text=True, timeout=300)
    assert out.stdout.split()[-2:] == ["True", "False"], (out.stdout + out.stderr)[-3000:]
