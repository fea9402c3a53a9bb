"""The docs stay true: the site builds strictly, the generated references match the code, every
graph in the docs validates, and every shell command in them runs or says why it does not.

A fenced block's kind is its info string. ``yaml`` and ``python`` blocks are graphs unless an
HTML comment ``<!-- snippet: why -->`` on the line before says otherwise; ``bash`` blocks are
run here unless the comment is ``<!-- not run: why -->`` or ``<!-- run by tests/<file>.py -->``.
``text`` and ``json`` blocks are output. Nothing else is allowed, so nothing slips through.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from flowrl.graph import load_graph

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "examples").rglob("*.md")])
KINDS = ("yaml", "python", "bash", "text", "json")
MARK = re.compile(r"^<!--\s*(snippet|not run|run by)\s*:?\s*(.*?)\s*-->$")
README_LINES = 300


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: where it starts, its info string, the mark before it, its text."""

    page: Path
    line: int
    kind: str
    mark: str  # "snippet", "not run", "run by" or ""
    reason: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a Markdown page, each with the HTML-comment mark on the line before it."""
    found, lines, i = [], page.read_text(encoding="utf-8").splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("```"):
            kind, start = lines[i][3:].strip(), i
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            before = lines[start - 1].strip() if start else ""
            mark = MARK.match(before)
            found.append(Block(page, start + 1, kind, mark.group(1) if mark else "", mark.group(2) if mark else "",
                               "\n".join(lines[start + 1:end]) + "\n"))
            i = end
        i += 1
    return found


ALL = [b for page in PAGES for b in blocks(page)]


def of(kind: str, mark: str = "") -> list[Block]:
    return [b for b in ALL if b.kind == kind and b.mark == mark]


def test_every_block_says_what_it_is():
    assert ALL, "no fenced blocks found"
    for b in ALL:
        assert b.kind in KINDS, f"{b.where}: a fence with info {b.kind!r}; label it one of {', '.join(KINDS)}"
        if b.mark:
            assert b.reason, f"{b.where}: '<!-- {b.mark}: -->' needs its reason"
        allowed = {"yaml": ("", "snippet"), "python": ("", "snippet"), "bash": ("", "not run", "run by")}
        assert b.mark in allowed.get(b.kind, ("",)), f"{b.where}: a {b.kind} block marked {b.mark!r}"


def test_the_readme_is_a_front_door_and_its_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= README_LINES
    commands = [b.text.strip() for b in blocks(ROOT / "README.md") if b.kind == "bash"]
    assert 'python -m pip install torch==2.13.0 -e ".[dev]" && python -m pytest' in commands
    assert "python -m pip install torch==2.13.0 -e . && flowrl run" in commands
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(r"&& python -m pytest\s*$", ci, re.M), ".ci/run no longer runs the README's `python -m pytest`"


@pytest.mark.parametrize("block", of("yaml"), ids=lambda b: b.where)
def test_every_yaml_graph_in_the_docs_validates(block, tmp_path):
    path = tmp_path / "graph.yaml"
    path.write_text(block.text, encoding="utf-8")
    report = load_graph(str(path)).check()
    assert report.ok, f"{block.where}: " + "; ".join(str(p) for p in report.errors)


@pytest.mark.parametrize("block", of("python"), ids=lambda b: b.where)
def test_every_python_graph_in_the_docs_validates(block, tmp_path):
    # one module name per block: a second block of the same name would be served from sys.modules
    path = tmp_path / f"docs_graph_{hashlib.sha1(block.where.encode()).hexdigest()[:12]}.py"
    path.write_text(block.text, encoding="utf-8")
    report = load_graph(str(path)).check()
    assert report.ok, f"{block.where}: " + "; ".join(str(p) for p in report.errors)


def test_blocks_run_by_another_test_are_run_there():
    for b in of("bash", "run by"):
        runner = ROOT / b.reason.split()[0]
        assert runner.is_file(), f"{b.where}: {b.reason!r} names no test file"
        assert str(b.page.relative_to(ROOT)) in runner.read_text(encoding="utf-8"), \
            f"{b.where}: {runner.name} does not read {b.page.name}"


def shell(tmp_path: Path, link: tuple[str, ...] = ("graphs", "tests", "examples", "benchmarks")
          ) -> tuple[Path, dict[str, str]]:
    """A scratch directory that looks like a checkout (the folders in ``link`` linked in), with
    ``flowrl`` and ``python`` on PATH meaning this interpreter and this checkout."""
    for name in link:
        (tmp_path / name).symlink_to(ROOT / name)
    bin_dir = tmp_path / ".bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    flowrl = bin_dir / "flowrl"
    flowrl.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m flowrl.cli "$@"\n')
    flowrl.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1", "FLOWRL_CACHE_DIR": str(tmp_path / ".cache")}
    return tmp_path, env


def run_block(text: str, cwd: Path, env: dict[str, str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-euo", "pipefail", "-c", text], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


# each command starts a Python that imports torch: seconds on an idle machine, minutes on a loaded one
@pytest.mark.timeout(900)
@pytest.mark.parametrize("block", of("bash"), ids=lambda b: b.where)
def test_every_shell_command_in_the_docs_runs(block, tmp_path):
    cwd, env = shell(tmp_path)
    done = run_block(block.text, cwd, env)
    assert done.returncode == 0, f"{block.where} exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}"


def test_the_generated_references_are_current(tmp_path):
    # a fresh process: operators that other tests declare must not join the page
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "docs_gen.py"), "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    for page in sorted(tmp_path.glob("*.md")):
        committed = ROOT / "docs" / "reference" / page.name
        assert committed.is_file() and committed.read_text(encoding="utf-8") == page.read_text(encoding="utf-8"), \
            f"docs/reference/{page.name} differs from the code: regenerate with `python scripts/docs_gen.py`"


def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("material", reason='mkdocs-material: python -m pip install torch==2.13.0 -e ".[dev]"')
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    for page in ("index.html", "your-own/index.html", "reference/operators/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for page in (ROOT / "docs").rglob("*.md"):
        assert str(page.relative_to(ROOT / "docs")) in nav, f"{page} is not in mkdocs.yml's nav"


def test_a_block_marked_or_not_is_read_as_the_rules_say(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n\n<!-- not run: needs a GPU -->\n```bash\nflowrl run\n```\n\n```yaml\nname: x\n```\n"
                    "<!-- snippet: part of a graph -->\n```yaml\nroles: {}\n```\n", encoding="utf-8")
    found = blocks(page)
    assert [(b.kind, b.mark, b.reason, b.text) for b in found] == [
        ("bash", "not run", "needs a GPU", "flowrl run\n"), ("yaml", "", "", "name: x\n"),
        ("yaml", "snippet", "part of a graph", "roles: {}\n")]
    (tmp_path / "scratch").mkdir()
    cwd, env = shell(tmp_path / "scratch")
    assert run_block("false", cwd, env).returncode == 1  # a failing command fails its block
    assert shutil.which("flowrl", path=env["PATH"]).startswith(str(cwd))
