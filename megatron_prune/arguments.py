"""Megatron-style argparse groups generated from the config dataclasses.

Flag names, types, defaults, choices and help all come from :mod:`megatron_prune.config`; a
field's docstring is its help text. Values are validated by the dataclasses' ``__post_init__``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import time
import types
import typing
from typing import Any, Callable

from megatron_prune.config import field_docs, flag_of
from megatron_prune.ranks import first_rank

__all__ = ["GIVEN", "ToolHelpFormatter", "UsageError", "add_dataclass_group", "build_parser", "configs_from_args",
           "fail_usage", "field_docs", "flag_of", "given_fields", "parse_configs"]


class UsageError(ValueError):
    """A flag or layout problem found before any rank does work."""


def refuse_plot_without_matplotlib(parser: argparse.ArgumentParser, plot: str | None) -> None:
    """The benchmark tools' ``--plot``: refused while parsing flags when matplotlib is missing,
    not after every mode has run."""
    if not plot:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        parser.error("--plot needs matplotlib: pip install -e '.[bench]' (or leave out --plot)")


def refuse_unwritable_outputs(parser: argparse.ArgumentParser, **paths: str | None) -> None:
    """The benchmark tools' output files and folders (``json="--json PATH"``-style keyword per flag,
    value the path; a name ending in ``_dir`` is a folder): probed by writing while parsing flags, as
    the trainers probe theirs, not found unwritable after every mode has run."""
    from megatron_prune.training.session import UsageError, check_writable

    for name, path in paths.items():
        if not path:
            continue
        flag = "--" + name.removesuffix("_dir").replace("_", "-")
        try:
            if name.endswith("_dir"):
                check_writable(flag, path)
            elif os.path.isdir(path):
                parser.error(f"{flag} {path}: is a directory")
            else:
                check_writable(flag, os.path.dirname(os.path.abspath(path)), file=path)
        except UsageError as exc:
            parser.error(str(exc))


def refuse_unrunnable_layout(parser: argparse.ArgumentParser, arch, *, tp: int, pp: int, vpp: int | None = None,
                             sp: bool = False) -> None:
    """The benchmark tools' layout against the model, checked while parsing flags as the trainers
    check theirs (one line, exit 2), instead of a traceback from every worker of every mode."""
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.session import UsageError, check_layout_fits

    if sp and tp == 1:
        parser.error("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if vpp is not None and pp < 2:
        parser.error(f"--virtual-pipeline-model-parallel-size {vpp} needs --pipeline-model-parallel-size > 1")
    try:
        check_layout_fits(arch, ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                               virtual_pipeline_model_parallel_size=vpp,
                                               sequence_parallel=sp or (tp > 1 and arch.is_moe)))
    except UsageError as exc:
        parser.error(str(exc))


def exit_without_device(prog: str, device: str | None, *, flag: str = "--device") -> None:
    """A benchmark tool's ``--device cuda`` on a machine without CUDA: one line, exit 2, before
    any worker starts (checked when the tool runs, not while parsing: its GPU commands still parse
    on a CPU machine). The check is the trainers' own (:func:`megatron_prune.accelerator.detect_kind`)."""
    if device != "cuda":
        return
    from megatron_prune.accelerator import AcceleratorError, detect_kind

    try:
        detect_kind("cuda")
    except AcceleratorError as exc:
        print(f"{prog}: error: {str(exc).replace('--device', flag, 1)}; use {flag} cpu", file=sys.stderr)
        sys.exit(2)


def ignore_expected_warnings() -> None:
    """Warnings no user can act on: Megatron's import-time notes about Apex/TE fallbacks, which the
    local spec expects, and the torch deprecations its dist checkpointing triggers (ShardedTensor,
    load_state_dict), which every rank would print at each load, and those of the collectives its
    sequence parallelism, expert dispatch and distributed optimizer call (attributed to torch)."""
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(megatron|torch\.distributed\.checkpoint)\.")
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated")


def tool_logging() -> None:
    """What the conversion tools print: megatron-prune's own INFO lines (what was converted,
    written, skipped) and every warning, without Megatron's start-up chatter, the patch
    registry's line per patch, or the deprecation warnings Megatron's dist checkpointing raises."""
    import logging
    import warnings

    if not logging.getLogger().handlers:  # as logging.basicConfig: a host that set up logging (pytest) keeps its own
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        logging.getLogger("megatron_prune").setLevel(logging.INFO)
        logging.getLogger("megatron_prune.patches").setLevel(logging.WARNING)
    ignore_expected_warnings()
    warnings.filterwarnings("ignore", category=UserWarning)


def refuse_bad_data_files(parser: argparse.ArgumentParser, flag: str, paths) -> None:
    """The benchmark tools' data flags: a missing file, a directory or an unknown suffix is refused
    while parsing flags (one line naming the flag, exit 2), not in a worker's traceback."""
    from megatron_prune.data.records import data_files_problem

    problem = data_files_problem(flag, paths)
    if problem:
        parser.error(problem)


class ToolHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help of the tools' hand-written parsers: the description as written, and each flag's
    default after its help unless the help already says it (or there is none to show)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text or default is None or default is False or default is argparse.SUPPRESS
                or default == [] or not action.option_strings or isinstance(action, argparse._HelpAction)):
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        return f"{text} (default: {shown})".lstrip()


_REPEAT_AFTER_LAUNCHER = """
import os, stat, sys, time
pid, message = int(sys.argv[1]), sys.argv[2]
deadline = time.monotonic() + 300
while time.monotonic() < deadline:
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rpartition(")")[2].split()[0] in ("Z", "X"):
                break
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        except PermissionError:
            pass
    time.sleep(0.02)
if stat.S_ISREG(os.fstat(2).st_mode):  # a log file: append, never overwrite what a script wrote after the launcher
    os.lseek(2, 0, os.SEEK_END)
sys.stderr.write(message + "\\n")
sys.stderr.flush()
"""


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def _record_for_torchrun(message: str) -> None:
    """Under torchrun: hand ``message`` to the launcher's failure report (its root-cause entry shows
    it instead of a pointer to the elastic docs) and repeat it once the launcher has printed that
    report and exited, so the message is the last line of the job's log (a detached process prints
    it, so in an interactive shell it can follow the prompt)."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        record = {"message": {"message": message, "extraInfo": {"py_callstack": message,
                                                                "timestamp": str(int(time.time()))}}}
        try:
            with open(error_file, "w", encoding="utf-8") as handle:
                json.dump(record, handle)
        except OSError:
            pass
    try:
        subprocess.Popen([sys.executable, "-c", _REPEAT_AFTER_LAUNCHER, str(os.getppid()), message],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    except OSError:
        pass


def fail_usage(exc: Exception | str, *, prefix: str = "megatron-prune: error: ") -> None:
    """One clear message from rank 0 (and from the first rank of every other node, whose log is
    often a file of its own), exit code 2, before any collective (:func:`exit_reported`)."""
    exit_reported(f"{prefix}{exc}", code=2)


def exit_reported(message: str, *, code: int, printed: bool = False) -> None:
    """Exit with ``code`` after ``message``, which every rank has found: rank 0 (and the first rank
    of every other node) prints it unless ``printed``; under torchrun it is also handed to the
    launcher's failure report and repeated after that report.

    torchrun stops all ranks as soon as one exits, and its report names the first rank that
    exited: the other ranks wait (up to 20 s) so that rank 0 is neither killed before it has
    printed nor beaten to the report's root cause.
    """
    if first_rank() or (_under_torchrun() and os.environ.get("LOCAL_RANK") == "0"):
        if not printed:
            print(message, file=sys.stderr, flush=True)
        if _under_torchrun():
            _record_for_torchrun(message)
    else:
        time.sleep(20.0)
    sys.exit(code)


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage dump, once per launch) instead of the full usage."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # argparse takes "-1e-5" for a flag (its negative-number pattern has no exponent), so
        # "--lr -1e-5" would say "expected one argument" instead of the range check's message.
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")

    def error(self, message: str):  # type: ignore[override]
        fail_usage(f"{message} (run with --help to see every flag, its choices and default)",
                   prefix=f"{self.prog}: error: ")
        raise AssertionError("unreachable")


class _ListReplaced(argparse.Action):
    """Store a list flag's values, and note a second mention that replaces the first one's values
    (argparse keeps the last list, as it keeps the last value of any flag: a script's trailing
    ``"$@"`` overrides its own flags that way), so that :func:`parse_configs` can say so."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[override]
        given = namespace.__dict__.setdefault(_LISTS_GIVEN, {})
        if self.dest in given:
            namespace.__dict__.setdefault(_LISTS_REPLACED, []).append(
                f"{option_string} given twice: its values {' '.join(map(str, values))} replace the earlier "
                f"{' '.join(map(str, given[self.dest]))}; give every value after one {option_string} to use them all")
        given[self.dest] = values
        setattr(namespace, self.dest, values)


_LISTS_GIVEN, _LISTS_REPLACED = "_list_flags_given", "_list_flags_replaced"


def _base_type(annotation: Any) -> tuple[type, bool]:
    """(scalar type, is_list) of an annotation like ``int | None`` or ``list[str]``."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(args[0])
    if origin is list:
        return typing.get_args(annotation)[0], True
    return annotation, False


def finite_float(text: str) -> float:
    """argparse type of every float flag: NaN and infinity are refused at parse time (no flag
    means anything by them, and comparisons like ``x < 0`` let them through)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def at_least(minimum: float, kind: type = int) -> Callable[[str], int | float]:
    """argparse type of a tool's count or amount: an int (or, with ``kind=float``, a finite float)
    of at least ``minimum``, refused at parse time with the flag named (a zero count failed later
    with a ZeroDivisionError or inside a worker)."""

    def parse(text: str) -> int | float:
        if kind is int:
            try:
                value = int(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        else:
            value = finite_float(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}")
        return value

    parse.__name__ = f"{kind.__name__} >= {minimum}"
    return parse


def above(minimum: float) -> Callable[[str], float]:
    """argparse type: a finite float above ``minimum`` (a timeout, a temperature)."""

    def parse(text: str) -> float:
        value = finite_float(text)
        if value <= minimum:
            raise argparse.ArgumentTypeError(f"must be > {minimum}, got {text}")
        return value

    parse.__name__ = f"float > {minimum}"
    return parse


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _metavar(flag: str) -> str:
    return flag.lstrip("-").upper().replace("-", "_")


def add_dataclass_group(parser: argparse.ArgumentParser, cls: type, title: str, *, defaults: bool = True) -> None:
    """Add one argument group with a flag per field of ``cls`` (dest = field name).

    Help shows each flag's documentation, its allowed values (choices), its default (switches:
    on/off; ``metadata["shown_default"]`` where the field's own default is a "not given" marker)
    and a metavar named after the flag. ``defaults=False``: every default is ``SUPPRESS``, so a
    parsed namespace holds only the flags given.
    """
    group = parser.add_argument_group(title, (cls.__doc__ or "").strip().splitlines()[0])
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = flag_of(f)
        help_text = docs.get(f.name, "")
        base, is_list = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        shown = f.metadata.get("shown_default", default)
        if not defaults:
            default = argparse.SUPPRESS
        dest = f"{cls.__name__}.{f.name}"
        if base is bool:
            group.add_argument(flag, *f.metadata.get("aliases", ()), dest=dest, action="store_true", default=default,
                               help=f"{help_text} (default: {_shown(bool(shown))})")
            if "bool_off" in f.metadata:
                group.add_argument(f.metadata["bool_off"], dest=dest, action="store_false",
                                   **({} if defaults else {"default": argparse.SUPPRESS}),
                                   help=f"Turn {flag} off (default: {_shown(bool(shown))}).")
            continue
        suffix = "" if shown is None or shown == [] else f" (default: {_shown(shown)})"
        kwargs: dict[str, Any] = dict(dest=dest, type=finite_float if base is float else base, default=default,
                                      help=f"{help_text}{suffix}")
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]  # argparse shows them as {a,b,...}
        else:
            kwargs["metavar"] = _metavar(flag)
        if is_list:
            kwargs["nargs"] = f.metadata.get("nargs", "+")
            kwargs["action"] = _ListReplaced
        group.add_argument(flag, *f.metadata.get("aliases", ()), **kwargs)


def build_parser(prog: str, groups: dict[str, type], description: str, *,
                 defaults: bool = True) -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, description=description, allow_abbrev=False)
    for title, cls in groups.items():
        add_dataclass_group(parser, cls, title, defaults=defaults)
    parser.add_argument("--dry-run", action="store_true",
                        help="Validate flags and layout, print the resolved settings, exit (default: off).")
    return parser


def configs_from_args(args: argparse.Namespace, groups: dict[str, type]) -> dict[str, Any]:
    """Instantiate each config class from the parsed flags (raising ValueError on bad values)."""
    values = vars(args)
    out = {}
    for cls in groups.values():
        kwargs = {f.name: values[f"{cls.__name__}.{f.name}"] for f in dataclasses.fields(cls)}
        out[cls.__name__] = cls(**kwargs)
    return out


GIVEN = "given_fields"
"""Attribute of the namespace :func:`parse_configs` returns: the ``Class.field`` dests of the flags on the
command line (:func:`given_fields`)."""


def given_fields(prog: str, groups: dict[str, type], description: str, argv: list[str] | None) -> frozenset[str]:
    """The ``Class.field`` dests of the flags on the command line ``argv``: what a parser whose defaults
    are all ``SUPPRESS`` sets. A default, or a value a preset fills in after parsing, is not among them."""
    namespace, _ = build_parser(prog, groups, description, defaults=False).parse_known_args(argv)
    return frozenset(name for name in vars(namespace) if "." in name)


def parse_configs(
    prog: str,
    groups: dict[str, type],
    description: str,
    argv: list[str] | None = None,
    *,
    unknown_handler: Any = None,
) -> tuple[argparse.Namespace, dict[str, Any]]:
    """Parse ``argv`` into config objects; a bad value exits with argparse's usage error.

    ``unknown_handler(unknown_flags)`` may accept flags we do not define (MindSpeed's, on
    Ascend) by returning normally or reject them by raising ValueError; without it unknown
    flags are an error. The namespace's ``given_fields`` (:data:`GIVEN`) holds the dests of the flags
    on the command line.
    """
    parser = build_parser(prog, groups, description)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        if unknown_handler is None:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        try:
            unknown_handler(unknown)
        except ValueError as exc:
            parser.error(str(exc))
    if first_rank():
        for line in getattr(args, _LISTS_REPLACED, ()):
            print(f"megatron-prune: warning: {line}", file=sys.stderr, flush=True)
    setattr(args, GIVEN, given_fields(prog, groups, description, argv))
    try:
        return args, configs_from_args(args, groups)
    except ValueError as exc:
        fail_usage(exc)  # one message from rank 0, exit code 2
        raise  # unreachable
