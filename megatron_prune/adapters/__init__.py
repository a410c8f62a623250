"""Adapters to other training stacks. :mod:`.mindspeed`: Ascend NPUs through MindSpeed.

Importing this package imports neither Megatron nor MindSpeed; the trainers call
:func:`~megatron_prune.adapters.mindspeed.bootstrap_device` first thing in ``main``.
"""

from megatron_prune.adapters.mindspeed import bootstrap_device, parse_mindspeed_flags, prepare_ascend

__all__ = ["bootstrap_device", "parse_mindspeed_flags", "prepare_ascend"]
