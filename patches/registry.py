"""The single registry of run-time changes to Megatron-Core (and MindSpeed).

A patch is *registered* (target dotted path -> builder of the replacement) at import of its
module and *applied* only by an explicit :func:`apply_patches` call. Applying is idempotent,
rebinds every alias that ``from x import f`` created in already-imported modules, logs one
line per patch, and is reversible with :func:`revert_patches`. A target that moved fails with
an error naming the symbol path and the installed version.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable

logger = logging.getLogger(__name__)

PATCH_MARK = "__megatron_prune_patch__"


class PatchTargetError(RuntimeError):
    """A registered patch cannot find, or no longer recognises, its target."""


@dataclass(frozen=True, kw_only=True)
class Patch:
    """One run-time change to one symbol."""

    name: str
    """Unique id, e.g. ``cpu.get_default_causal_mask``."""
    target: str
    """Dotted path of the symbol replaced: ``pkg.module.func`` or ``pkg.module.Class.method``."""
    reason: str
    """Why the change is needed, in one sentence (logged when applied)."""
    build: Callable[[Any], Any]
    """Takes the original object, returns its replacement."""
    group: str
    """Patches are applied by group (``cpu``, ``mindspeed``, ...)."""
    checked_versions: tuple[str, ...] = ()
    """Package versions of the target's distribution this patch was verified against."""
    package: str = "megatron-core"
    """Distribution that owns the target (for error messages and version checks)."""


@dataclass
class _Applied:
    patch: Patch
    original: Any
    replacement: Any
    bindings: list[tuple[Any, str]] = field(default_factory=list)


_REGISTRY: dict[str, Patch] = {}
_BY_TARGET: dict[str, str] = {}
_APPLIED: dict[str, _Applied] = {}


def installed_version(package: str) -> str:
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:  # noqa: BLE001 - any failure means "unknown"
        return "not installed"


def register(patch: Patch) -> Patch:
    """Add ``patch`` to the registry. Registering a name or a target twice is an error."""
    if patch.name in _REGISTRY:
        raise ValueError(f"patch {patch.name!r} is already registered")
    if patch.target in _BY_TARGET:
        raise ValueError(
            f"target {patch.target} is already patched by {_BY_TARGET[patch.target]!r}; "
            "compose both changes in one patch"
        )
    _REGISTRY[patch.name] = patch
    _BY_TARGET[patch.target] = patch.name
    return patch


def registered(group: str | None = None) -> list[Patch]:
    return [p for p in _REGISTRY.values() if group is None or p.group == group]


def is_applied(name: str) -> bool:
    return name in _APPLIED


def _resolve(patch: Patch) -> tuple[Any, str, Any]:
    """Return (owner, attribute, current value) of the patch's target."""
    parts = patch.target.split(".")
    for split in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:split])
        try:
            owner: Any = importlib.import_module(module_name)
        except ImportError:
            continue
        try:
            for attr in parts[split:-1]:
                owner = getattr(owner, attr)
            if not hasattr(owner, parts[-1]):
                raise AttributeError(parts[-1])
        except AttributeError:
            break
        if isinstance(owner, type) and parts[-1] not in owner.__dict__:
            # Patching the subclass would shadow the base's method, and undoing it would leave the
            # shadow: the target moved, so the patch must be rewritten for where it now lives.
            raise PatchTargetError(
                f"patch {patch.name!r}: {patch.target} is now inherited, not defined on {owner.__qualname__}, in "
                f"{patch.package} {installed_version(patch.package)}; the patch needs updating")
        # Read through __dict__ so staticmethod/classmethod wrappers are preserved.
        value = owner.__dict__[parts[-1]] if isinstance(owner, type) else getattr(owner, parts[-1])
        return owner, parts[-1], value
    raise PatchTargetError(
        f"patch {patch.name!r}: target {patch.target} not found in {patch.package} "
        f"{installed_version(patch.package)} (checked on {', '.join(patch.checked_versions) or '?'})"
    )


def _aliases(original: Any, owner: Any, attr: str) -> list[tuple[Any, str]]:
    """Every module global in Megatron/MindSpeed/us that is bound to ``original``."""
    found = [(owner, attr)]
    if isinstance(owner, type):
        return found
    for mod_name, module in list(sys.modules.items()):
        if module is None or not mod_name.startswith(("megatron", "mindspeed")):
            continue
        for name, value in list(vars(module).items()):
            if value is original and (module, name) != (owner, attr):
                found.append((module, name))
    return found


def apply_patches(group: str, *, names: list[str] | None = None) -> list[str]:
    """Apply the registered patches of ``group`` (or only ``names``). Returns the applied names.

    Already-applied patches are skipped, so calling this twice is harmless.
    """
    _import_patch_modules()
    done = []
    for patch in registered(group):
        if names is not None and patch.name not in names:
            continue
        if patch.name in _APPLIED:
            continue
        owner, attr, original = _resolve(patch)
        if getattr(original, PATCH_MARK, None) == patch.name:
            continue
        replacement = patch.build(original)
        target_fn = replacement.__func__ if isinstance(replacement, (staticmethod, classmethod)) else replacement
        try:
            setattr(target_fn, PATCH_MARK, patch.name)
            target_fn.__wrapped__ = original
        except (AttributeError, TypeError):
            pass
        bindings = _aliases(original, owner, attr)
        for module, name in bindings:
            setattr(module, name, replacement)
        _APPLIED[patch.name] = _Applied(patch, original, replacement, bindings)
        logger.info("megatron-prune patch %s -> %s: %s", patch.name, patch.target, patch.reason)
        done.append(patch.name)
    return done


def revert_patches(group: str | None = None) -> list[str]:
    """Undo applied patches (of ``group``), restoring every rebound alias."""
    undone = []
    for name in list(_APPLIED):
        applied = _APPLIED[name]
        if group is not None and applied.patch.group != group:
            continue
        for module, attr in applied.bindings:
            setattr(module, attr, applied.original)
        del _APPLIED[name]
        undone.append(name)
    return undone


def rewrite_source(*replacements: tuple[str, str]) -> Callable[[Any], Any]:
    """Builder that recompiles a function with exact textual replacements in its source.

    Used for CUDA literals buried inside long Megatron functions (``device="cuda"``,
    ``torch.cuda.current_device()``, ``'torch.cuda.FloatTensor'`` type checks) where wrapping
    cannot reach. Each ``old`` string must occur in the source, otherwise the target changed
    and the build fails naming it. The function is compiled in its own module's globals, with
    ``__class__`` bound so zero-argument ``super()`` still works in methods.
    """

    def build(original: Any) -> Any:
        wrapper = type(original) if isinstance(original, (staticmethod, classmethod)) else None
        func = inspect.unwrap(original.__func__ if wrapper else original)
        source = textwrap.dedent(inspect.getsource(func))
        for old, new in replacements:
            if old not in source:
                package = "mindspeed" if func.__module__.startswith("mindspeed") else "megatron-core"
                raise PatchTargetError(
                    f"{func.__module__}.{func.__qualname__}: expected text {old!r} not found in "
                    f"{package} {installed_version(package)}; the patch needs updating"
                )
            source = source.replace(old, new)
        # staticmethod/classmethod are re-applied below; other decorators are kept.
        lines = [ln for ln in source.splitlines() if ln.strip() not in ("@staticmethod", "@classmethod")]
        body = textwrap.indent("\n".join(lines), "    ")
        owner_cls = None
        qual = func.__qualname__.split(".")
        if len(qual) > 1:
            owner_cls = getattr(sys.modules[func.__module__], qual[0], None)
        factory_src = f"def __mp_factory(__class__):\n{body}\n    return {func.__name__}\n"
        namespace: dict[str, Any] = {}
        code = compile(factory_src, f"<megatron-prune patch of {func.__module__}.{func.__qualname__}>", "exec")
        exec(code, func.__globals__, namespace)  # noqa: S102 - compiling Megatron's own source
        new_func = namespace["__mp_factory"](owner_cls)
        new_func.__qualname__ = func.__qualname__
        new_func.__module__ = func.__module__
        new_func.__doc__ = func.__doc__
        return wrapper(new_func) if wrapper else new_func

    return build


def _import_patch_modules() -> None:
    """Import every module that registers patches (registration happens at import)."""
    from . import megatron_cpu, megatron_no_te  # noqa: F401
