"""Mutation harness: seed one known bug at a time into a copy of the tree and run the tests that must catch it.

A *mutant* is a small, real bug written as a text edit of today's code. For each mutant the
harness copies the working tree (tracked and untracked, not ignored files, as
``git ls-files -co --exclude-standard`` lists them), applies the edit to the copy, and runs only
that mutant's own tests there::

    python -m pytest -q -x -p no:cacheprovider -m "" <tests>

with the copy as working directory and ``PYTHONPATH``, so the copy's code is what the tests, the
ranks they spawn and the CLIs they launch import (never the checkout the project is
pip-installed from). Each pytest is forked from a server that imported torch, Megatron-Core,
transformers and pytest once (never the project's own packages), which saves about 2 s of a
mutant's pytest run (on 2 cores: 1.6-2 s instead of 3.5-4 s for a unit test); ``--fresh`` starts
a new interpreter instead.
A mutant is

- ``killed`` when pytest exits 1 (a test failed): the suite notices the bug;
- ``survived`` when pytest exits 0: the suite does not notice it;
- ``error`` for anything else: the edit does not apply (its ``old`` text must occur exactly
  once), pytest could not collect or run the tests (exit 2-5), the time limit passed, or the copy
  was not what got imported.

Any survivor or error makes the exit status 1 (2 for a usage error).

Mutants live in catalogs, ``tests/mutation/catalog_*.py``: plain modules defining
``MUTANTS: list[dict]`` with keys ``name`` (unique, kebab-case), ``why`` (the real bug it stands
for), ``file`` (relative to the repository root), ``old`` (exact source text, once in the file),
``new`` (its replacement) and ``tests`` (pytest node ids or paths relative to the root).

    python tools/mutants.py                      # every catalog, every mutant
    python tools/mutants.py --catalog tests/mutation/catalog_core.py --only packing-causal-mask
    python tools/mutants.py --list               # what would run
    python tools/mutants.py --jobs 2 --json mutants.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import importlib.util
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CATALOG_GLOB = "tests/mutation/catalog_*.py"
KEYS = ("name", "why", "file", "old", "new", "tests")
NAME_RE = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
COPY_ENV = "MEGATRON_PRUNE_MUTANT_COPY"
"""Set to the copy's root in every test run; tests can tell they run under the harness."""
EXPECT_ENV = "MEGATRON_PRUNE_MUTANT_EXPECT"
GUARD_PLUGIN = "_mutants_import_guard"

# Packages whose source must come from the copy, with the file each must be imported from.
# ``megatron_prune.patches`` lives in ``patches/`` and the editable install maps it there
# explicitly (in the real checkout), so the copy gets a ``megatron_prune/patches`` link to its own
# ``patches/`` that the normal path search finds first.
COPY_PACKAGES = {
    "megatron_prune": "megatron_prune/__init__.py",
    "megatron_prune.patches": "patches/__init__.py",
}
PACKAGE_LINKS = {"megatron_prune/patches": "patches"}

PYTEST_ARGS = ["-q", "-x", "-p", "no:cacheprovider", "-m", ""]
PRELOAD = ("numpy", "torch", "torch.distributed", "pytest", "megatron.core", "megatron.core.models.gpt",
           "megatron.core.optimizer", "megatron.core.distributed", "megatron.core.pipeline_parallel",
           "transformers")
"""Third-party modules the fork server imports once (any that fail to import are left out).
Never the project's packages: those must come from each mutant's copy."""
FORK_SERVER_FLAG = "--fork-server"
KILLED, SURVIVED, ERROR = "killed", "survived", "error"
PASSED = "passed"
"""Status of a baseline run (no edit) whose tests pass."""


class CatalogError(ValueError):
    """A catalog that cannot be loaded or a mutant that breaks the catalog format."""


@dataclass
class Mutant:
    name: str
    why: str
    file: str
    old: str
    new: str
    tests: list[str]
    catalog: str


@dataclass
class Result:
    name: str
    catalog: str
    file: str
    tests: list[str]
    status: str
    """killed, survived or error."""
    seconds: float
    why: str = ""
    """The real bug the mutant stands for."""
    returncode: int | None = None
    """pytest's exit status (None when pytest did not run or was stopped)."""
    detail: str = ""
    """Why it is an error, or what the harness noticed."""
    output_tail: str = ""
    """The end of pytest's output (kept for survivors and errors)."""
    cpu_seconds: float | None = None
    """CPU time of the test run (pytest and every process it waited for), independent of load."""


@dataclass
class Options:
    root: Path
    jobs: int = 1
    timeout: float = 600.0
    python: str = sys.executable
    keep: bool = False
    verbose: bool = False
    fresh: bool = False
    """Start a new interpreter for every pytest instead of forking it from the fork server."""
    workdir: Path = field(default_factory=lambda: Path(tempfile.gettempdir()))


# ---------------------------------------------------------------------------------------------
# catalogs
# ---------------------------------------------------------------------------------------------


def default_catalogs(root: Path) -> list[Path]:
    """Every ``tests/mutation/catalog_*.py`` that exists under ``root`` (missing ones are skipped)."""
    return sorted(root.glob(CATALOG_GLOB))


def _display(path: Path, root: Path) -> str:
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)


def load_catalog(path: Path, *, root: Path) -> list[Mutant]:
    """The mutants of one catalog file, checked against the format; CatalogError names what is wrong."""
    label = _display(path, root)
    spec = importlib.util.spec_from_file_location(f"_mutant_catalog_{abs(hash(str(path)))}", path)
    if spec is None or spec.loader is None:
        raise CatalogError(f"{label}: cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - any failure of a catalog is reported, not raised
        raise CatalogError(f"{label}: importing it failed: {type(exc).__name__}: {exc}") from None
    entries = getattr(module, "MUTANTS", None)
    if not isinstance(entries, list):
        raise CatalogError(f"{label}: must define MUTANTS as a list of dicts; got {type(entries).__name__}")
    mutants = []
    for position, entry in enumerate(entries):
        mutants.append(_check_entry(entry, label=f"{label}: MUTANTS[{position}]", catalog=label))
    return mutants


def _check_entry(entry, *, label: str, catalog: str) -> Mutant:
    if not isinstance(entry, dict):
        raise CatalogError(f"{label}: must be a dict; got {type(entry).__name__}")
    name = entry.get("name")
    if isinstance(name, str):
        label = f"{label} ({name!r})"
    missing = [k for k in KEYS if k not in entry]
    extra = sorted(set(entry) - set(KEYS))
    if missing or extra:
        raise CatalogError(f"{label}: needs exactly the keys {', '.join(KEYS)}; missing {missing}, unknown {extra}")
    for key in ("name", "why", "file", "old", "new"):
        if not isinstance(entry[key], str):
            raise CatalogError(f"{label}: {key!r} must be a string; got {type(entry[key]).__name__}")
    if not NAME_RE.match(entry["name"]):
        raise CatalogError(f"{label}: name must be kebab-case (lower-case words joined by '-')")
    if not entry["why"].strip():
        raise CatalogError(f"{label}: 'why' must say which real bug the mutant stands for")
    if not entry["old"]:
        raise CatalogError(f"{label}: 'old' is empty")
    if entry["old"] == entry["new"]:
        raise CatalogError(f"{label}: 'new' equals 'old' (the mutant changes nothing)")
    tests = entry["tests"]
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t for t in tests):
        raise CatalogError(f"{label}: 'tests' must be a non-empty list of pytest node ids or paths")
    for rel in [entry["file"], *(t.split("::")[0] for t in tests)]:
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise CatalogError(f"{label}: {rel!r} must be a path relative to the repository root")
    return Mutant(catalog=catalog, tests=list(tests), **{k: entry[k] for k in KEYS if k != "tests"})


def load_catalogs(paths: list[Path], *, root: Path) -> tuple[list[Mutant], list[Result]]:
    """Mutants of every catalog, and an error result for each catalog or name that is broken."""
    mutants: list[Mutant] = []
    problems: list[Result] = []
    for path in paths:
        try:
            mutants.extend(load_catalog(path, root=root))
        except CatalogError as exc:
            label = _display(path, root)
            problems.append(Result(name=f"<catalog {label}>", catalog=label, file="", tests=[], status=ERROR,
                                   seconds=0.0, detail=str(exc)))
    seen: dict[str, str] = {}
    unique = []
    for m in mutants:
        if m.name in seen:
            problems.append(Result(name=m.name, catalog=m.catalog, file=m.file, tests=m.tests, status=ERROR,
                                   seconds=0.0, detail=f"name {m.name!r} is also used in {seen[m.name]}"))
            continue
        seen[m.name] = m.catalog
        unique.append(m)
    return unique, problems


# ---------------------------------------------------------------------------------------------
# the copy
# ---------------------------------------------------------------------------------------------


def tree_files(root: Path) -> list[str]:
    """Tracked and untracked-but-not-ignored files of the working tree (never ``.venv``)."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, capture_output=True,
                             check=False)
    except FileNotFoundError:
        raise RuntimeError("git is needed to list the working tree's files") from None
    if out.returncode != 0:
        raise RuntimeError(f"git ls-files failed in {root}: {out.stderr.decode(errors='replace').strip()}")
    files = []
    for rel in sorted(set(out.stdout.decode().split("\0"))):
        if not rel or rel.split("/")[0] == ".venv":
            continue
        if (root / rel).is_file() or (root / rel).is_symlink():  # deleted-but-tracked files are skipped
            files.append(rel)
    return files


def snapshot(root: Path, dest: Path) -> None:
    """Copy the working tree into ``dest`` once; every mutant starts from this snapshot."""
    for rel in tree_files(root):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target, follow_symlinks=False)


def prepare_copy(pristine: Path, dest: Path) -> None:
    shutil.copytree(pristine, dest, symlinks=True)
    for link, target in PACKAGE_LINKS.items():
        where = dest / link
        if (dest / target).is_dir() and where.parent.is_dir() and not where.exists():
            os.symlink(os.path.relpath(dest / target, where.parent), where)


def expected_modules(copy: Path) -> dict[str, str]:
    """Module -> the file in the copy it must be imported from (packages the copy has)."""
    return {name: str((copy / rel).resolve()) for name, rel in COPY_PACKAGES.items() if (copy / rel).is_file()}


def apply_edit(mutant: Mutant, copy: Path) -> None:
    path = copy / mutant.file
    if not path.is_file():
        raise CatalogError(f"mutant {mutant.name}: file {mutant.file} does not exist")
    text = path.read_text(encoding="utf-8")
    count = text.count(mutant.old)
    if count != 1:
        snippet = textwrap.shorten(" ".join(mutant.old.split()), 160)
        raise CatalogError(
            f"mutant {mutant.name}: its 'old' text occurs {count} times in {mutant.file} (must be exactly once; "
            f"the catalog has drifted from the code): {snippet!r}"
        )
    path.write_text(text.replace(mutant.old, mutant.new), encoding="utf-8")


def applicability(mutant: Mutant, root: Path) -> str | None:
    """Why ``mutant`` cannot run against the tree at ``root`` (its edit or test paths), or None."""
    path = root / mutant.file
    if not path.is_file():
        return f"file {mutant.file} does not exist"
    count = path.read_text(encoding="utf-8").count(mutant.old)
    if count != 1:
        return f"its 'old' text occurs {count} times in {mutant.file} (must be exactly once)"
    missing = [t for t in mutant.tests if not (root / t.split("::")[0]).exists()]
    if missing:
        return f"test paths not found: {missing}"
    return None


GUARD_SOURCE = f'''
"""pytest plugin written by tools/mutants.py: fail the run unless the copy's packages are imported."""
import importlib
import json
import os

import pytest


def pytest_configure(config):
    expected = json.loads(os.environ.get("{EXPECT_ENV}", "{{}}"))
    for name, path in expected.items():
        found = os.path.realpath(importlib.import_module(name).__file__)
        if found != path:
            raise pytest.UsageError(f"mutation harness: {{name}} was imported from {{found}}, not the copy's {{path}}")
'''


def write_guard(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{GUARD_PLUGIN}.py").write_text(GUARD_SOURCE, encoding="utf-8")


def mutant_env(copy: Path, guard_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "PYTEST_ADDOPTS", "PYTEST_PLUGINS"):
        env.pop(key, None)
    env.update(
        PYTHONPATH=os.pathsep.join([str(copy), str(guard_dir)]),
        **{COPY_ENV: str(copy), EXPECT_ENV: json.dumps(expected_modules(copy))},
    )
    return env


def check_fresh_interpreter(*, python: str, copy: Path, env: dict[str, str]) -> str | None:
    """A new interpreter with the test environment (as a spawned rank or torchrun gets) imports
    the copy's packages; returns what is wrong, or None."""
    expected = json.loads(env[EXPECT_ENV])
    if not expected:
        return None
    code = ("import importlib, json, os, sys; "
            "print(json.dumps({n: os.path.realpath(importlib.import_module(n).__file__) for n in sys.argv[1:]}))")
    out = subprocess.run([python, "-c", code, *expected], cwd=copy.parent, env=env, capture_output=True, text=True,
                         timeout=120, check=False)
    if out.returncode != 0:
        return f"importing {', '.join(expected)} from the copy failed:\n{out.stderr[-2000:]}"
    found = json.loads(out.stdout.strip().splitlines()[-1])
    wrong = {n: f for n, f in found.items() if f != expected[n]}
    if wrong:
        return f"a fresh interpreter imports these from outside the copy: {wrong}"
    return None


# ---------------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------------


_RUNNING: set[int] = set()
"""Process ids of the pytest runs in progress (each leads a session of its own)."""
_SERVERS: set["ForkServer"] = set()
_RUNNING_LOCK = threading.Lock()
_STOPPING = threading.Event()


def _stop_everything(signum, frame) -> None:  # noqa: ARG001 - signal handler signature
    """On SIGTERM/SIGINT stop every running pytest with its ranks (they run in sessions of their
    own, so a signal to the harness alone would leave them behind) and the fork servers, then exit."""
    _STOPPING.set()
    with _RUNNING_LOCK:
        running, servers = list(_RUNNING), list(_SERVERS)
    for pid in running:
        _kill_tree(pid)
    for server in servers:
        server.close()
    sys.exit(128 + signum)


def _kill_tree(pid: int) -> None:
    """Stop pytest and everything it started (torchrun ranks start sessions of their own)."""
    family = []
    try:
        import psutil

        family = psutil.Process(pid).children(recursive=True)
    except Exception:  # noqa: BLE001 - psutil missing or the process already gone
        pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for child in family:
        try:
            child.kill()
        except Exception:  # noqa: BLE001
            pass


def _kill_leftovers(copy: Path) -> int:
    """Kill processes still running inside ``copy`` after its test run (a rank a test lost track
    of, waiting forever in a collective). Only this run's copy is searched, so nothing else is
    touched. Returns how many were killed."""
    try:
        import psutil
    except ImportError:
        return 0
    inside = str(copy.resolve())
    leftovers = []
    for proc in psutil.process_iter():
        try:
            cwd = proc.cwd()
        except (psutil.Error, OSError):
            continue
        if cwd == inside or cwd.startswith(inside + os.sep):
            leftovers.append(proc)
    for proc in leftovers:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(leftovers, timeout=30)
    return len(leftovers)


def _wait_with_cpu(proc: subprocess.Popen, *, timeout: float) -> tuple[int, float]:
    """Wait for ``proc``; its exit code and the CPU seconds it and the children it waited for used.

    CPU time does not grow with the machine's load, unlike wall time, so it is what tells whether
    a catalog fits its budget on a quiet CI machine.
    """
    deadline = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage.ru_utime + usage.ru_stime
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(proc.args, timeout)
        time.sleep(0.1)


class FreshLauncher:
    """Runs each pytest in a new interpreter (``--fresh``); the same start/wait interface as
    :class:`ForkServer`, one run at a time."""

    def __init__(self, python: str):
        self.python = python
        self.proc: subprocess.Popen | None = None

    def start(self, *, cwd: Path, env: dict[str, str], args: list[str], log: Path) -> int:
        """Start ``python -m pytest <args>`` in ``cwd``, leading a session of its own; its process id."""
        with log.open("w") as out:
            self.proc = subprocess.Popen([self.python, "-m", "pytest", *args], cwd=cwd, env=env, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        return self.proc.pid

    def wait(self, *, timeout: float) -> tuple[int, float]:
        """The exit status and CPU seconds of the run :meth:`start` started (TimeoutExpired after ``timeout``)."""
        return _wait_with_cpu(self.proc, timeout=timeout)


class ForkServer:
    """A process (``tools/mutants.py --fork-server``) that imported :data:`PRELOAD` and forks one
    pytest run per request, as ``python -m pytest`` in the copy would run it: the child leads a
    session of its own, takes the copy's directory, environment and ``sys.path``, writes to the
    log and exits through the interpreter's normal shutdown. The server waits for the child and
    replies with its exit status and CPU time. One request at a time; one server per worker."""

    def __init__(self, python: str):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.proc = subprocess.Popen([python, str(Path(__file__).resolve()), FORK_SERVER_FLAG], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self._buffer = b""
        with _RUNNING_LOCK:
            _SERVERS.add(self)

    def _reply(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise subprocess.TimeoutExpired(self.proc.args, timeout)
            if select.select([fd], [], [], remaining)[0]:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise RuntimeError(f"the fork server exited (status {self.proc.poll()})")
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def start(self, *, cwd: Path, env: dict[str, str], args: list[str], log: Path) -> int:
        """Fork a pytest run; its process id. The server must have imported :data:`PRELOAD` (the
        first request waits for that)."""
        request = {"cwd": str(cwd), "env": env, "args": args, "log": str(log)}
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        return self._reply(timeout=300)["pid"]

    def wait(self, *, timeout: float) -> tuple[int, float]:
        """The exit status and CPU seconds of the run :meth:`start` forked (TimeoutExpired after ``timeout``)."""
        reply = self._reply(timeout=timeout)
        return reply["rc"], reply["cpu"]

    def close(self) -> None:
        with _RUNNING_LOCK:
            _SERVERS.discard(self)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _serve_forks() -> None:
    """The fork server's loop (``--fork-server``); a forked child leaves it by raising SystemExit."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module missing here is imported by the test that needs it
            pass
    gc.freeze()  # the children's collections skip the preloaded objects (and copy none of their pages)
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            raise SystemExit(_forked_pytest(request))
        replies.write(json.dumps({"pid": pid}).encode() + b"\n")
        replies.flush()
        _, status, usage = os.wait4(pid, 0)
        replies.write(json.dumps({"rc": os.waitstatus_to_exitcode(status),
                                  "cpu": usage.ru_utime + usage.ru_stime}).encode() + b"\n")
        replies.flush()


def _forked_pytest(request: dict) -> int:
    """In the forked child: become ``python -m pytest <args>`` run in the copy; pytest's exit status."""
    try:
        os.setsid()
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        sys.stdin = open(os.devnull)  # noqa: SIM115 - the child's stdin for its whole life
        os.dup2(sys.stdin.fileno(), 0)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:1] = [request["cwd"], *entries]  # the server's [0] is this tool's folder
        import pytest

        sys.argv = [str(Path(pytest.__file__).with_name("__main__.py")), *request["args"]]
        return int(pytest.main(request["args"]))
    except BaseException:  # noqa: BLE001 - reported in the log; 3 is pytest's "internal error"
        import traceback

        traceback.print_exc()
        return 3
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def run_mutant(mutant: Mutant | None, *, tests: list[str], pristine: Path, guard_dir: Path, opts: Options,
               name: str, catalog: str, file: str) -> Result:
    """Apply ``mutant`` (None: no edit, the baseline) to a fresh copy and run ``tests`` there."""
    t0 = time.monotonic()

    def result(status: str, *, returncode=None, detail="", output="") -> Result:
        return Result(name=name, catalog=catalog, file=file, tests=tests, status=status,
                      why=mutant.why if mutant else "", seconds=round(time.monotonic() - t0, 1),
                      returncode=returncode, detail=detail,
                      output_tail=output[-4000:] if status in (SURVIVED, ERROR) or opts.verbose else "")

    if _STOPPING.is_set():
        return result(ERROR, detail="not run: the harness was stopped")
    base = Path(tempfile.mkdtemp(prefix=f"mutant-{name}-", dir=opts.workdir))
    copy = base / "tree"
    try:
        prepare_copy(pristine, copy)
        if mutant is not None:
            try:
                apply_edit(mutant, copy)
            except CatalogError as exc:
                return result(ERROR, detail=str(exc))
        missing = [t for t in tests if not (copy / t.split("::")[0]).exists()]
        if missing:
            return result(ERROR, detail=f"test paths not found: {missing}")
        env = mutant_env(copy, guard_dir)
        problem = check_fresh_interpreter(python=opts.python, copy=copy, env=env)
        if problem:
            return result(ERROR, detail=f"the copy is not what gets imported: {problem}")
        log = base / "pytest.log"
        args = [*PYTEST_ARGS, "-p", GUARD_PLUGIN, *tests]
        launcher = FreshLauncher(opts.python) if opts.fresh else _fork_server(opts)
        pid = launcher.start(cwd=copy, env=env, args=args, log=log)
        with _RUNNING_LOCK:
            _RUNNING.add(pid)
        try:
            rc, cpu = launcher.wait(timeout=opts.timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(pid)
            launcher.wait(timeout=120)
            return result(ERROR, detail=f"timed out after {opts.timeout:g} s (neither killed nor survived)",
                          output=log.read_text(errors="replace"))
        finally:
            with _RUNNING_LOCK:
                _RUNNING.discard(pid)
            stray = _kill_leftovers(copy)
        output = log.read_text(errors="replace")
        if rc == 1:
            res = result(KILLED, returncode=rc, output=output)
        elif rc == 0:
            res = result(SURVIVED, returncode=rc, detail="its tests pass with the bug in place", output=output)
        else:
            meaning = {2: "interrupted (collection error?)", 3: "internal error",
                       4: "usage error (unknown test id?)", 5: "no tests collected"}.get(rc, "unexpected exit status")
            res = result(ERROR, returncode=rc, detail=f"pytest exit {rc}: {meaning}", output=output)
        res.cpu_seconds = round(cpu, 1)
        if stray:
            res.detail = "; ".join(filter(None, [res.detail, f"stopped {stray} process(es) the tests left running"]))
        return res
    finally:
        if not opts.keep:
            shutil.rmtree(base, ignore_errors=True)


_WORKER = threading.local()


def _fork_server(opts: Options) -> ForkServer:
    """This worker thread's fork server, started on first use (a dead one is replaced)."""
    server = getattr(_WORKER, "server", None)
    if server is None or server.proc.poll() is not None:
        if server is not None:
            server.close()
        server = _WORKER.server = ForkServer(opts.python)
    return server


def expected_cost(tests: list[str]) -> int:
    """A rough rank of how long ``tests`` take: end-to-end launches > spawned ranks > the rest."""
    return max(2 if t.startswith("tests/e2e/") else 1 if t.startswith("tests/distributed/") else 0 for t in tests)


def run_all(mutants: list[Mutant], *, opts: Options, baseline: bool = False, progress=print) -> list[Result]:
    """Run every mutant (``jobs`` at a time) against one snapshot of the tree; results in input order."""
    opts.workdir.mkdir(parents=True, exist_ok=True)
    top = Path(tempfile.mkdtemp(prefix="mutants-", dir=opts.workdir))
    if opts.keep:
        progress(f"[mutants] copies are kept under {top}")
    lock = threading.Lock()
    try:
        pristine = top / "pristine"
        snapshot(opts.root, pristine)
        guard_dir = top / "guard"
        write_guard(guard_dir)
        jobs: list[tuple[Mutant | None, str, list[str]]] = []
        if baseline:  # once per distinct list of tests
            for tests in dict.fromkeys(tuple(m.tests) for m in mutants):
                first = next(m.name for m in mutants if tuple(m.tests) == tests)
                jobs.append((None, f"baseline-{first}", list(tests)))
        jobs.extend((m, m.name, m.tests) for m in mutants)

        def one(job):
            mutant, name, tests = job
            catalog = mutant.catalog if mutant else "(baseline)"
            file = mutant.file if mutant else ""
            try:
                res = run_mutant(mutant, tests=tests, pristine=pristine, guard_dir=guard_dir, opts=opts, name=name,
                                 catalog=catalog, file=file)
            except Exception as exc:  # noqa: BLE001 - one broken run must not hide the others' results
                res = Result(name=name, catalog=catalog, file=file, tests=tests, status=ERROR, seconds=0.0,
                             detail=f"the harness failed on this mutant: {type(exc).__name__}: {exc}")
            if mutant is None:
                # Unmutated, the tests must pass: a failure there would make a kill meaningless.
                res.status, res.detail = (PASSED, "") if res.status == SURVIVED else (
                    ERROR, f"fails without any mutation: {res.detail}".rstrip(": "))
            with lock:
                progress(f"[mutants] {res.status:8s} {res.seconds:7.1f}s  {name}" + (
                    f"  ({res.detail})" if res.detail else ""))
            return res

        # Longest first (CLI launches, then spawned ranks, then the rest) shortens the parallel run.
        order = sorted(range(len(jobs)), key=lambda i: -expected_cost(jobs[i][2]))
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, opts.jobs)) as pool:
            futures = {i: pool.submit(one, jobs[i]) for i in order}
            return [futures[i].result() for i in range(len(jobs))]
    finally:
        with _RUNNING_LOCK:
            servers = list(_SERVERS)
        for server in servers:
            server.close()
        if not opts.keep:
            shutil.rmtree(top, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------


def table(results: list[Result]) -> str:
    rows = [("mutant", "catalog", "status", "seconds", "cpu s", "tests")]
    for r in results:
        cpu = "-" if r.cpu_seconds is None else f"{r.cpu_seconds:.1f}"
        rows.append((r.name, Path(r.catalog).name, r.status, f"{r.seconds:.1f}", cpu, ", ".join(r.tests)))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:5], widths)) + "  " + row[5] for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * 5)
    return "\n".join(lines)


def summary(results: list[Result]) -> dict:
    counts = {s: sum(r.status == s for r in results) for s in (KILLED, SURVIVED, ERROR, PASSED)}
    return {**counts, "total": len(results), "seconds": round(sum(r.seconds for r in results), 1),
            "cpu_seconds": round(sum(r.cpu_seconds or 0.0 for r in results), 1)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tools/mutants.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--catalog", action="append", type=Path, metavar="PATH",
                   help=f"catalog file to run (repeatable); default: every {CATALOG_GLOB} that exists")
    p.add_argument("--only", metavar="NAME[,NAME]", help="run only these mutants (comma-separated names)")
    p.add_argument("--list", action="store_true",
                   help="list the selected mutants and their tests, and check that each edit applies; run nothing")
    p.add_argument("--jobs", type=int, default=1, help="mutants run in parallel (default 1)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds per mutant; a mutant still running then is stopped and counts as an error "
                        "(default 600)")
    p.add_argument("--json", type=Path, metavar="PATH", help="write every result and a summary as JSON")
    p.add_argument("--baseline", action="store_true",
                   help="first run each mutant's tests on the unmutated copy; they must pass")
    p.add_argument("--root", type=Path, default=REPO, help="repository to copy (default: the one holding this tool)")
    p.add_argument("--keep", action="store_true",
                   help="keep the temporary copies (the folder is printed) for inspection")
    p.add_argument("--verbose", action="store_true", help="keep pytest's output for killed mutants too")
    p.add_argument("--fresh", action="store_true",
                   help="start a new interpreter for every pytest run instead of forking it from a server that "
                        "imported torch, Megatron-Core and pytest once (slower; for a result to compare)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = args.root.resolve()
    if args.jobs < 1:
        print("tools/mutants.py: error: --jobs must be >= 1", file=sys.stderr)
        return 2
    if args.timeout <= 0:
        print("tools/mutants.py: error: --timeout must be positive", file=sys.stderr)
        return 2
    paths = args.catalog if args.catalog else default_catalogs(root)
    absent = [str(p) for p in paths if not p.is_file()]
    if absent:
        print(f"tools/mutants.py: error: no such catalog: {', '.join(absent)}", file=sys.stderr)
        return 2
    if not paths:
        print(f"tools/mutants.py: error: no catalogs found ({CATALOG_GLOB} under {root})", file=sys.stderr)
        return 2
    mutants, problems = load_catalogs([p.resolve() for p in paths], root=root)
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(wanted) - {m.name for m in mutants})
        if unknown:
            print(f"tools/mutants.py: error: no mutant named {', '.join(unknown)} in "
                  f"{', '.join(_display(p, root) for p in paths)}", file=sys.stderr)
            return 2
        mutants = [m for m in mutants if m.name in wanted]
        problems = [r for r in problems if r.name in wanted or r.name.startswith("<catalog")]
    if args.list:
        drifted = 0
        for m in mutants:
            print(f"{m.name}  [{m.catalog}]  {m.file}\n    why: {m.why}\n    tests: {' '.join(m.tests)}")
            problem = applicability(m, root)
            if problem:
                drifted += 1
                print(f"    ERROR: {problem}")
        for r in problems:
            print(f"ERROR {r.name}: {r.detail}")
        return 1 if problems or drifted else 0
    opts = Options(root=root, jobs=args.jobs, timeout=args.timeout, keep=args.keep, verbose=args.verbose,
                   fresh=args.fresh)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _stop_everything)
    t0 = time.monotonic()
    for r in problems:
        print(f"[mutants] {r.status:8s} {r.seconds:7.1f}s  {r.name}  ({r.detail})", flush=True)
    try:
        results = problems + run_all(mutants, opts=opts, baseline=args.baseline,
                                     progress=lambda line: print(line, flush=True))
    except RuntimeError as exc:  # the tree cannot be listed (not a git checkout, no git)
        print(f"tools/mutants.py: error: {exc}", file=sys.stderr)
        return 2
    wall = round(time.monotonic() - t0, 1)
    print()
    print(table(results))
    stats = {**summary(results), "wall_seconds": wall, "jobs": args.jobs}
    baselines = f", {stats['passed']} baselines passed" if args.baseline else ""
    print(f"\n{stats['killed']} killed, {stats['survived']} survived, {stats['error']} errors{baselines} "
          f"of {stats['total']} in {wall:.0f} s (jobs={args.jobs}; {stats['cpu_seconds']:.0f} CPU seconds)")
    for r in results:
        if r.status in (SURVIVED, ERROR):
            print(f"\n=== {r.status}: {r.name} ({r.catalog}: {r.file})\n{r.detail}")
            if r.output_tail:
                print(r.output_tail[-2500:])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"summary": stats, "results": [asdict(r) for r in results]}, indent=2))
    return 1 if stats["survived"] or stats["error"] else 0


if __name__ == "__main__":
    if sys.argv[1:] == [FORK_SERVER_FLAG]:
        _serve_forks()  # a forked pytest run leaves through SystemExit with pytest's status
        sys.exit(0)
    sys.exit(main())
