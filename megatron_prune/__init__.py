"""megatron-prune: pruned DPO and GRPO post-training on Megatron-Core."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

_CHECKOUT_PATCHES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "patches")


class _CheckoutPatchesFinder(importlib.abc.MetaPathFinder):
    """``megatron_prune.patches`` from a source checkout used without ``pip install``.

    The repository keeps every run-time patch in its top-level ``patches/`` folder, which
    installs as ``megatron_prune.patches``. A checkout put on ``PYTHONPATH`` has no such package;
    this finder, consulted after the installed ones, maps the name to that folder.
    """

    def find_spec(self, name, path=None, target=None):
        init = os.path.join(_CHECKOUT_PATCHES, "__init__.py")
        if name != __name__ + ".patches" or not os.path.isfile(init):
            return None
        return importlib.util.spec_from_file_location(name, init, submodule_search_locations=[_CHECKOUT_PATCHES])


if not any(isinstance(f, _CheckoutPatchesFinder) for f in sys.meta_path):
    sys.meta_path.append(_CheckoutPatchesFinder())
