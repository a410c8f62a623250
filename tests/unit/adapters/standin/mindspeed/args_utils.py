"""Test stand-in for ``mindspeed.args_utils`` (see ../README.md): the pre-parse of sys.argv."""

import argparse

from mindspeed.features_manager import MindSpeedFeaturesManager

_MINDSPEED_ARGS = None


def _add_unknown(args, unknown):
    """Unknown ``--flag [values...]`` become ``flag=True`` / one string / a list of strings."""
    key, values = None, []
    for token in list(unknown) + ["--"]:
        if token.startswith("-"):
            if key is not None:
                args[key] = True if not values else values[0] if len(values) == 1 else values
            name, _, value = token.partition("=")
            key = name[2:].replace("-", "_") or None
            values = [value] if value else []
        else:
            values.append(token)
    return args


def get_mindspeed_args(get_defaults=False):
    global _MINDSPEED_ARGS
    if not get_defaults and _MINDSPEED_ARGS is not None:
        return _MINDSPEED_ARGS
    parser = argparse.ArgumentParser(description="MindSpeed Arguments", allow_abbrev=False)
    MindSpeedFeaturesManager.register_features_args(parser)
    known, unknown = parser.parse_known_args([] if get_defaults else None)
    args = argparse.Namespace(**_add_unknown(vars(known), unknown))
    if not get_defaults:
        _MINDSPEED_ARGS = args
    return args
