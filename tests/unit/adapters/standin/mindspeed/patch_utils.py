"""Test stand-in for ``mindspeed.patch_utils`` (see ../README.md); written for the tests, not copied.

Semantics reproduced from MindSpeed's documentation of ``register_patch``:

1. a patch is registered (target dotted path -> ``new_func``) and takes effect only when
   ``apply_patches`` runs;
2. a ``new_func`` whose ``__name__`` ends in ``wrapper`` or ``decorator`` is a decorator: it is
   applied to the replacement (or to the original when there is none), decorators stack in
   registration order and registering the same decorator object twice keeps one;
3. any other ``new_func`` replaces the target; a second replacement is an error unless
   ``force_patch``;
4. applying rebinds the target and every module attribute of the same name bound to the value
   the target had just before; it can run again after more registrations, rebuilding the chain
   from the original;
5. ``remove_patches`` puts the originals back and drops every decorator.
"""

import importlib
import sys


class Patch:
    def __init__(self, target, new_func, create_dummy):
        if create_dummy:
            raise NotImplementedError("the test stand-in does not create dummy modules")
        self.target = target
        self.owner = None
        self.original = None
        self.replacement = None
        self.wrappers = []
        self.final = None
        self.is_applied = False
        self.set_patch_func(new_func)

    def set_patch_func(self, new_func, force_patch=False):
        if getattr(new_func, "__name__", "").endswith(("wrapper", "decorator")):
            if new_func not in self.wrappers:
                self.wrappers.append(new_func)
        else:
            if self.replacement is not None and not force_patch:
                raise RuntimeError(f"the patch of {self.target} exist !")
            self.replacement = new_func
        self.is_applied = False

    def apply_patch(self):
        if self.is_applied:
            return
        owner, name = _resolve_owner(self.target)
        current = getattr(owner, name)
        if self.owner is None:
            self.owner, self.original = owner, current
        final = self.replacement if self.replacement is not None else self.original
        for wrapper in self.wrappers:
            final = wrapper(final)
        setattr(self.owner, name, final)
        for module in list(sys.modules.values()):
            if getattr(module, name, None) is current:
                setattr(module, name, final)
        self.final = final
        self.is_applied = True

    def remove_patch(self):
        if self.owner is not None:
            name = self.target.rsplit(".", 1)[1]
            for module in list(sys.modules.values()):
                if getattr(module, name, None) is self.final:
                    setattr(module, name, self.original)
            setattr(self.owner, name, self.original)
        self.replacement = None
        self.final = None
        self.wrappers.clear()
        self.is_applied = False


def _resolve_owner(target):
    """(module or class that holds the attribute, attribute name)."""
    path, name = target.rsplit(".", 1)
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for attr in parts[split:]:
            owner = getattr(owner, attr)
        return owner, name
    raise ModuleNotFoundError(target)


class MindSpeedPatchesManager:
    patches_info = {}

    @staticmethod
    def register_patch(orig_func_name, new_func=None, force_patch=False, create_dummy=False):
        info = MindSpeedPatchesManager.patches_info
        if orig_func_name not in info:
            info[orig_func_name] = Patch(orig_func_name, new_func, create_dummy)
        else:
            info[orig_func_name].set_patch_func(new_func, force_patch)

    @staticmethod
    def remove_patches():
        for patch in MindSpeedPatchesManager.patches_info.values():
            patch.remove_patch()

    @staticmethod
    def apply_patches():
        for patch in MindSpeedPatchesManager.patches_info.values():
            patch.apply_patch()
