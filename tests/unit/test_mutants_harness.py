"""tools/mutants.py on a tiny synthetic repository: what counts as killed, survived and error."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "mutants.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("mutants_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


CALC = "def add(a, b):\n    # adds\n    return a + b\n"
TESTS = {
    "tests/test_calc.py": "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n",
    "tests/test_broken.py": "def test_always_fails():\n    assert False\n",
    # Leaves a process behind in the copy (as a test that loses track of a rank would).
    "tests/test_leak.py": textwrap.dedent("""
        import subprocess
        import sys

        from calc import add


        def test_add_leaving_a_sleeper():
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "mutants-leak-marker"],
                             start_new_session=True)
            assert add(2, 3) == 5
    """),
    # What ``python -m pytest`` run in the copy has: its directory before site-packages, its own
    # session, the harness's variables, no path to the tool's own folder.
    "tests/test_started_as.py": textwrap.dedent("""
        import os
        import sys

        import calc


        def test_started_as_python_m_pytest_in_the_copy():
            copy = os.environ["MEGATRON_PRUNE_MUTANT_COPY"]
            assert os.getcwd() == copy
            site = min(i for i, p in enumerate(sys.path) if "site-packages" in p)
            assert copy in sys.path[:site]
            assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == copy
            assert os.path.dirname(calc.__file__) == copy
            assert not any(os.path.isfile(os.path.join(p, "mutants.py")) for p in sys.path if p)
            assert sys.argv[0].endswith(os.path.join("pytest", "__main__.py"))
            assert os.getsid(0) == os.getpid()
            assert calc.TWO == 2
    """),
    # Never finishes on its own: only the harness's --timeout ends it.
    "tests/test_hang.py": textwrap.dedent("""
        import time


        def test_hangs():
            time.sleep(600)
    """),
    # Only a child interpreter, started outside the copy, reads the mutated constant: PYTHONPATH
    # must lead it to the copy (the original tree is not on any path).
    "tests/test_child.py": textwrap.dedent("""
        import subprocess
        import sys


        def test_child_process_uses_the_copy():
            out = subprocess.run([sys.executable, "-c", "import calc; print(calc.TWO)"], cwd="/",
                                 capture_output=True, text=True, check=True)
            assert out.stdout.strip() == "2"
    """),
}
CATALOG = textwrap.dedent('''
    MUTANTS = [
        {"name": "hangs", "why": "its test outlives the timeout", "file": "calc.py",
         "old": "# adds", "new": "# sums", "tests": ["tests/test_hang.py"]},
        {"name": "add-minus", "why": "subtracts", "file": "calc.py", "old": "return a + b", "new": "return a - b",
         "tests": ["tests/test_calc.py"]},
        {"name": "child-sees-copy", "why": "a constant read in a child process", "file": "calc.py",
         "old": "TWO = 2", "new": "TWO = 3", "tests": ["tests/test_child.py"]},
        {"name": "comment-only", "why": "changes nothing the tests can see", "file": "calc.py",
         "old": "# adds", "new": "# sums", "tests": ["tests/test_calc.py"]},
        {"name": "drifted", "why": "old text no longer in the file", "file": "calc.py",
         "old": "return a * b", "new": "return 0", "tests": ["tests/test_calc.py"]},
        {"name": "breaks-collection", "why": "a syntax error is not a failing test", "file": "calc.py",
         "old": "return a + b", "new": "return a +", "tests": ["tests/test_calc.py"]},
        {"name": "unknown-test", "why": "names a test id that does not exist", "file": "calc.py",
         "old": "return a + b", "new": "return a - b", "tests": ["tests/test_calc.py::test_nothing"]},
        {"name": "leaves-a-process", "why": "its test leaves a process running", "file": "calc.py",
         "old": "return a + b", "new": "return a - b", "tests": ["tests/test_leak.py"]},
        {"name": "sees-the-copys-path", "why": "a mutant the tests see only as python -m pytest in the copy",
         "file": "calc.py", "old": "TWO = 2", "new": "TWO = 3", "tests": ["tests/test_started_as.py"]},
        {"name": "blames-broken-test", "why": "its test fails with or without the bug", "file": "calc.py",
         "old": "# adds", "new": "# sums", "tests": ["tests/test_broken.py"]},
    ]
''')


@pytest.fixture
def toy_repo(tmp_path):
    root = tmp_path / "repo"
    (root / "tests").mkdir(parents=True)
    (root / "pytest.ini").write_text("[pytest]\n")
    (root / "calc.py").write_text(CALC + "TWO = 2\n")
    for rel, text in TESTS.items():
        (root / rel).write_text(text)
    (root / ".gitignore").write_text("ignored/\n")
    (root / "ignored").mkdir()
    (root / "ignored" / "calc.py").write_text("raise SystemExit('ignored files must not be copied')\n")
    (root / "catalog.py").write_text(CATALOG)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    return root


def run_tool(root: Path, *args: str) -> tuple[int, str]:
    out = subprocess.run([sys.executable, str(TOOL), "--root", str(root), "--catalog", str(root / "catalog.py"),
                          *args], capture_output=True, text=True, timeout=300)
    return out.returncode, out.stdout + out.stderr


@pytest.mark.parametrize("launch", [[], ["--fresh"]], ids=["forked", "fresh-interpreter"])
def test_statuses_exit_code_and_json(toy_repo, tmp_path, launch):
    """The same statuses whether pytest is forked from the fork server (the default) or started anew."""
    report = tmp_path / "report.json"
    rc, output = run_tool(toy_repo, "--jobs", "2", "--json", str(report), *launch, "--only",
                          "add-minus,child-sees-copy,comment-only,drifted,breaks-collection,unknown-test,"
                          "leaves-a-process")
    assert rc == 1, output
    data = json.loads(report.read_text())
    status = {r["name"]: r["status"] for r in data["results"]}
    assert status == {
        "add-minus": "killed",
        "child-sees-copy": "killed",
        "comment-only": "survived",
        "drifted": "error",
        "breaks-collection": "error",
        "unknown-test": "error",
        "leaves-a-process": "killed",
    }, output
    by_name = {r["name"]: r for r in data["results"]}
    assert "occurs 0 times in calc.py" in by_name["drifted"]["detail"]
    assert by_name["breaks-collection"]["returncode"] == 2
    assert by_name["unknown-test"]["returncode"] == 4
    assert data["summary"]["killed"] == 3 and data["summary"]["survived"] == 1 and data["summary"]["error"] == 3
    # The process a test left running in the copy is stopped with it.
    assert "stopped 1 process(es)" in by_name["leaves-a-process"]["detail"]
    assert not [p for p in psutil.process_iter(["cmdline"]) if "mutants-leak-marker" in (p.info["cmdline"] or [])]
    assert "comment-only" in output and "survived" in output
    # The original tree is never edited.
    assert (toy_repo / "calc.py").read_text() == CALC + "TWO = 2\n"


@pytest.mark.parametrize("launch", [[], ["--fresh"]], ids=["forked", "fresh-interpreter"])
def test_the_tests_run_as_python_m_pytest_in_the_copy(toy_repo, tmp_path, launch):
    """Unmutated, the test that checks how it was started passes (forked or not); mutated, it fails."""
    report = tmp_path / "report.json"
    rc, output = run_tool(toy_repo, "--only", "sees-the-copys-path", "--baseline", "--json", str(report), *launch)
    status = {r["name"]: r["status"] for r in json.loads(report.read_text())["results"]}
    assert status == {"baseline-sees-the-copys-path": "passed", "sees-the-copys-path": "killed"}, output
    assert rc == 0, output


@pytest.mark.parametrize("launch", [[], ["--fresh"]], ids=["forked", "fresh-interpreter"])
def test_a_run_past_the_timeout_is_stopped_and_the_worker_goes_on(toy_repo, tmp_path, launch):
    """One worker: the hanging run is stopped and counts as an error; the next run on the same
    worker (the same fork server, when forked) still gets its own verdict."""
    report = tmp_path / "report.json"
    rc, output = run_tool(toy_repo, "--jobs", "1", "--timeout", "5", "--only", "hangs,add-minus",
                          "--json", str(report), *launch)
    assert rc == 1, output
    by_name = {r["name"]: r for r in json.loads(report.read_text())["results"]}
    assert by_name["hangs"]["status"] == "error" and "timed out after 5 s" in by_name["hangs"]["detail"], output
    assert by_name["add-minus"]["status"] == "killed", output
    assert not [p for p in psutil.process_iter(["cmdline"]) if "test_hang.py" in " ".join(p.info["cmdline"] or [])]


def test_only_killed_mutants_exit_zero(toy_repo):
    rc, output = run_tool(toy_repo, "--only", "add-minus")
    assert rc == 0, output
    assert "1 killed, 0 survived, 0 errors" in output


def test_baseline_exposes_a_kill_that_means_nothing(toy_repo, tmp_path):
    """A test that fails without the bug "kills" it; --baseline runs it unmutated first and says so."""
    report = tmp_path / "report.json"
    rc, output = run_tool(toy_repo, "--only", "blames-broken-test,add-minus", "--baseline", "--json", str(report))
    assert rc == 1, output
    status = {r["name"]: r["status"] for r in json.loads(report.read_text())["results"]}
    assert status == {"baseline-add-minus": "passed", "baseline-blames-broken-test": "error",
                      "add-minus": "killed", "blames-broken-test": "killed"}, output
    assert "fails without any mutation" in output


def test_list_runs_nothing_and_flags_a_drifted_edit(toy_repo):
    rc, output = run_tool(toy_repo, "--list")
    assert rc == 1 and "add-minus" in output and "unknown-test" in output
    assert "ERROR: its 'old' text occurs 0 times in calc.py" in output
    rc, output = run_tool(toy_repo, "--list", "--only", "add-minus,comment-only")
    assert rc == 0 and "ERROR" not in output


def test_unknown_name_and_missing_catalog_are_usage_errors(toy_repo):
    rc, output = run_tool(toy_repo, "--only", "no-such-mutant")
    assert rc == 2 and "no mutant named no-such-mutant" in output
    out = subprocess.run([sys.executable, str(TOOL), "--root", str(toy_repo), "--catalog", "missing.py"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "no such catalog" in out.stderr


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"name": "x"}, "needs exactly the keys"),
        ({"name": "Bad_Name", "why": "w", "file": "f.py", "old": "a", "new": "b", "tests": ["t.py"]}, "kebab-case"),
        ({"name": "same", "why": "w", "file": "f.py", "old": "a", "new": "a", "tests": ["t.py"]}, "changes nothing"),
        ({"name": "no-tests", "why": "w", "file": "f.py", "old": "a", "new": "b", "tests": []}, "non-empty list"),
        ({"name": "abs", "why": "w", "file": "/etc/f.py", "old": "a", "new": "b", "tests": ["t.py"]}, "relative"),
    ],
)
def test_catalog_format_errors_name_the_mutant(tmp_path, entry, message):
    tool = load_tool()
    path = tmp_path / "catalog_bad.py"
    path.write_text(f"MUTANTS = [{entry!r}]\n")
    with pytest.raises(tool.CatalogError, match=message) as info:
        tool.load_catalog(path, root=tmp_path)
    assert "catalog_bad.py: MUTANTS[0]" in str(info.value)


def test_duplicate_names_and_broken_catalogs_are_errors_not_crashes(tmp_path):
    tool = load_tool()
    entry = {"name": "dup", "why": "w", "file": "f.py", "old": "a", "new": "b", "tests": ["t.py"]}
    (tmp_path / "catalog_a.py").write_text(f"MUTANTS = [{entry!r}]\n")
    (tmp_path / "catalog_b.py").write_text(f"MUTANTS = [{entry!r}]\n")
    (tmp_path / "catalog_c.py").write_text("raise ImportError('half-written')\n")
    paths = sorted(tmp_path.glob("catalog_*.py"))
    mutants, problems = tool.load_catalogs(paths, root=tmp_path)
    assert [m.name for m in mutants] == ["dup"]
    details = " | ".join(p.detail for p in problems)
    assert "also used in catalog_a.py" in details and "catalog_c.py: importing it failed" in details
    assert all(p.status == "error" for p in problems)


@pytest.mark.parametrize("linked", [True, False], ids=["with-link", "without-link"])
def test_copy_imports_its_own_packages_or_the_run_is_refused(tmp_path, monkeypatch, linked):
    """``megatron_prune.patches`` lives in ``patches/``; the editable install maps it to the real
    checkout. The copy's link makes the copy's ``patches/`` win, in a fresh interpreter and in the
    pytest process; without it, both checks refuse the run (an error, never a kill)."""
    tool = load_tool()
    pristine = tmp_path / "pristine"
    for package in ("megatron_prune", "patches"):
        shutil.copytree(REPO / package, pristine / package, ignore=shutil.ignore_patterns("__pycache__"))
    (pristine / "tests").mkdir()
    (pristine / "tests" / "test_trivial.py").write_text("def test_nothing():\n    pass\n")
    if not linked:
        monkeypatch.setattr(tool, "PACKAGE_LINKS", {})
    copy = tmp_path / "copy"
    tool.prepare_copy(pristine, copy)
    guard = tmp_path / "guard"
    tool.write_guard(guard)
    env = tool.mutant_env(copy, guard)
    assert set(json.loads(env[tool.EXPECT_ENV])) == {"megatron_prune", "megatron_prune.patches"}
    problem = tool.check_fresh_interpreter(python=sys.executable, copy=copy, env=env)
    run = subprocess.run([sys.executable, "-m", "pytest", *tool.PYTEST_ARGS, "-p", tool.GUARD_PLUGIN,
                          "tests/test_trivial.py"], cwd=copy, env=env, capture_output=True, text=True, timeout=120)
    if linked:
        assert problem is None
        assert run.returncode == 0, run.stdout + run.stderr
    else:
        assert problem is not None and "megatron_prune.patches" in problem
        assert run.returncode == 4 and "megatron_prune.patches was imported from" in run.stdout + run.stderr
