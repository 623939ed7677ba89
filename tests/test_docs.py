"""The README and the documentation site (docs/, built by scripts/docs.sh): every command they show is one the project
accepts, every Python snippet parses and imports names that exist, every link resolves, and the README stays short.

Commands are parsed, never run: ``lightning-gaudi-ds ...`` by the console script's own argparse parser (and click's,
for ``fabric run``); ``python examples/*.py`` and ``python benchmarks/*.py`` by the parser their ``main()`` builds
(argparse's or LightningCLI's jsonargparse), stopped as soon as it has parsed; the ``bash scripts/*.sh`` commands by
what each script accepts. Paths into the repository must exist. A command of another kind fails the test until a
checker for it is added here.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import os
import re
import shlex
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import click
import pytest
import tomllib
import yaml

from tests.procs import REPO, run_job

README = REPO / "README.md"
PAGES = sorted((REPO / "docs").glob("*.md"))
DOCS = [README, *PAGES]
REPO_DIRS = ("examples/", "scripts/", "benchmarks/", "requirements/", "docs/", "tests/", ".ci/")
# Programs of the user's or of other projects that the docs show beside ours: only their repo paths are checked.
OTHERS = {"pip", "python train.py", "python pretrain.py"}
_FENCE = re.compile(r"^\s*```(\w*)\s*$")


def _blocks(path: Path, langs: tuple[str, ...]) -> Iterator[tuple[int, str]]:
    """(line number, text) of each fenced block of one of these languages (indented fences too)."""
    lang, start, body = None, 0, []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        match = _FENCE.match(line)
        if match and lang is None:
            lang, start, body, indent = match.group(1), number, [], len(line) - len(line.lstrip())
        elif match and not match.group(1):
            if lang in langs:
                yield start, "\n".join(body)
            lang = None
        elif lang is not None:
            body.append(line[indent:])


def _commands() -> list[tuple[str, list[str]]]:
    """Every shell command of a ``bash`` block: (where, argv) with brackets of optional parts removed."""
    found, seen = [], set()
    for path in DOCS:
        for start, text in _blocks(path, ("bash", "sh")):
            for line in text.replace("\\\n", " ").splitlines():
                argv = [t.strip("[]") for t in shlex.split(line, comments=True)]
                if argv and tuple(argv) not in seen:  # one check per command, where it is first shown
                    seen.add(tuple(argv))
                    found.append((f"{path.relative_to(REPO)}:{start}: {line.strip()[:70]}", argv))
    return found


COMMANDS = _commands()


class _Parsed(Exception):
    """Raised by the patched parse_args once a script's parser has accepted its arguments."""


_PARSERS: dict[str, argparse.ArgumentParser] = {}  # script -> the parser its main() built (built once: ~0.5 s each)


def _stop_after_parse(monkeypatch: pytest.MonkeyPatch, cls: type, script: str) -> None:
    """The outermost parse_args (jsonargparse's sub-commands call theirs inside) raises _Parsed once it returns."""
    original, depth = cls.parse_args, [0]

    def parse_args(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not depth[0]:
            _PARSERS.setdefault(script, self)
        depth[0] += 1
        try:
            result = original(self, *args, **kwargs)
        finally:
            depth[0] -= 1
        if depth[0]:
            return result
        raise _Parsed

    monkeypatch.setattr(cls, "parse_args", parse_args)


def _load(script: Path) -> ModuleType:
    name = f"_docs_{script.parent.name}_{script.stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, script)
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        with _environ_kept():  # an example's import may set its own defaults (its cache folders, say)
            spec.loader.exec_module(module)
    return sys.modules[name]


@contextlib.contextmanager
def _environ_kept() -> Iterator[None]:
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _parse_script(script: str, args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs the script's main() until its parser has accepted ``args`` (argparse's or jsonargparse's)."""
    path = REPO / script
    assert path.is_file(), f"{script} does not exist"
    import jsonargparse

    monkeypatch.syspath_prepend(str(path.parent))  # the scripts import their siblings
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", [str(path), *args])
    _stop_after_parse(monkeypatch, argparse.ArgumentParser, script)
    _stop_after_parse(monkeypatch, jsonargparse.ArgumentParser, script)
    with pytest.raises(_Parsed), _environ_kept():
        if script in _PARSERS:
            _PARSERS[script].parse_args(args)
        else:
            _load(path).main()


def _parse_cli(args: list[str]) -> None:
    from lightning_gaudi_ds.cli import build_parser

    if args[:1] == ["fabric"]:  # Lightning's `fabric run` is a click command: click parses without running it
        from lightning_gaudi_ds.fabric_cli import fabric_group

        group = fabric_group()
        assert args[1] in group.commands, args
        if "--help" not in args:
            with tempfile.TemporaryDirectory() as scratch:
                for name in args[2:]:  # the user's script, which click wants to exist
                    if name.endswith(".py") and not name.startswith(REPO_DIRS):
                        (Path(scratch) / name).touch()
                here = os.getcwd()
                os.chdir(scratch)
                try:
                    group.commands[args[1]].make_context(args[1], args[2:])
                finally:
                    os.chdir(here)
        return
    try:
        build_parser().parse_args(args)
    except SystemExit as exit:  # --help
        assert exit.code == 0 and "--help" in args, f"lightning-gaudi-ds {shlex.join(args)}: refused"


def _check_test_sh(args: list[str]) -> None:
    if args[:1] == ["--deepspeed"]:
        assert (REPO / "requirements" / f"lock-deepspeed-{args[1]}.txt").is_file(), args
        args = args[2:]
    if args[:1] == ["--lint"]:
        args = args[1:]
    markers = {m.split(":")[0] for m in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]
               ["ini_options"]["markers"]}
    for i, arg in enumerate(args):
        if arg == "-m":
            names = set(re.findall(r"\w+", args[i + 1])) - {"not", "and", "or"}
            assert names <= markers, f"unknown pytest markers {names - markers}"
        elif arg.startswith("-") and arg not in {"-q", "-x", "-v", "--soak"}:
            raise AssertionError(f"scripts/test.sh {arg}: not a documented option")


def _check(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):  # VAR=value command
        argv = argv[1:]
    program = " ".join(argv[:2]) if argv[0] == "python" and not argv[1].startswith("-") else argv[0]
    if argv[:3] == ["python", "-m", "lightning_gaudi_ds"]:
        _parse_cli(argv[3:])
    elif argv[0] == "lightning-gaudi-ds":
        _parse_cli(argv[1:])
    elif argv[0] == "python" and argv[1].startswith(("examples/", "benchmarks/")):
        _parse_script(argv[1], argv[2:], monkeypatch)
    elif argv[0] == "bash":
        script, args = argv[1], argv[2:]
        assert (REPO / script).is_file(), f"{script} does not exist"
        if script == "scripts/test.sh":
            _check_test_sh(args)
        elif script == "scripts/train.sh":
            default = ["fit", "--config", "examples/configs/zero2_bf16.yaml"]
            _parse_script("examples/train_lm.py", [*default, *args], monkeypatch)
        elif script == "scripts/docs.sh":
            assert len(args) <= 1, args
        else:
            assert not args, f"{script} takes no arguments"
    elif argv[0] == "sbatch":  # SLURM's: a batch script of the repository, then the training script's arguments
        script = next((a for a in argv[1:] if not a.startswith("-")), "")
        assert script.endswith(".sbatch") and (REPO / script).is_file(), f"sbatch {script}: no such batch script"
    elif program in OTHERS:
        if argv[:2] == ["pip", "install"]:
            extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
            for extra in re.findall(r"lightning_gaudi_ds\[(\w+)\]", " ".join(argv)):
                assert extra in extras, f"no extra {extra!r} in pyproject.toml"
    else:
        raise AssertionError(f"no checker for `{program}`: add one to tests/test_docs.py")


@pytest.mark.parametrize("argv", [argv for _, argv in COMMANDS], ids=[where for where, _ in COMMANDS])
def test_every_command_shown_parses(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    for token in argv:  # arguments, --opt=value and VAR=value naming a file of the repository
        value = token.split("=", 1)[-1]
        if value.startswith(REPO_DIRS) and "*" not in value:
            assert (REPO / value).exists(), f"{value} does not exist"
    with _environ_kept():  # a first `import lightning` sets two of torch's variables (tests/test_environ.py)
        _check(argv, monkeypatch)


def test_commands_are_found_on_every_page_that_shows_some() -> None:
    where = {w.split(":")[0] for w, _ in COMMANDS}
    assert {"README.md", "docs/launching.md", "docs/planner.md", "docs/checkpoints.md"} <= where
    assert len(COMMANDS) > 30


def test_a_wrong_command_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkers refuse what the project does not accept (a check that cannot fail checks nothing)."""
    for argv in (["lightning-gaudi-ds", "spawn", "--world-size", "8", "train.py"],
                 ["lightning-gaudi-ds", "plan", "--params", "13e9", "--stage", "2"],
                 ["lightning-gaudi-ds", "fabric", "run", "--strategy", "hpu_deepspeed_stage_4", "x.py"],
                 ["python", "examples/fabric_lm.py", "--stages", "2"],
                 ["python", "benchmarks/planner.py", "--hiden", "64"],
                 ["python", "examples/train_lm.py", "fit", "--trainer.max_stepz", "100"],
                 ["bash", "scripts/test.sh", "-m", "not multiproces"],
                 ["bash", "scripts/hpu_check.sh", "--fast"],
                 ["make", "docs"]):
        try:
            with _environ_kept():
                _check(argv, monkeypatch)
        except (AssertionError, SystemExit, click.UsageError) as refused:
            assert not isinstance(refused, SystemExit) or refused.code == 2, argv  # argparse's usage error
        else:
            raise AssertionError(f"accepted: {shlex.join(argv)}")


def _python_snippets() -> list[tuple[str, str]]:
    return [(f"{p.relative_to(REPO)}:{start}", text) for p in DOCS for start, text in _blocks(p, ("python",))]


@pytest.mark.parametrize("where,text", _python_snippets(), ids=[w for w, _ in _python_snippets()])
def test_every_python_snippet_parses_and_imports_what_exists(where: str, text: str) -> None:
    tree = ast.parse(text, where)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_gaudi_ds"):
            with _environ_kept():  # a first `import lightning` sets two of torch's variables (tests/test_environ.py)
                module = importlib.import_module(node.module)
                missing = [a.name for a in node.names if not hasattr(module, a.name)]  # the names load lazily
            assert not missing, f"{where}: {node.module} has no {missing}"


def test_links_resolve() -> None:
    """Relative links of the README and the pages point at files that exist (mkdocs --strict checks the site)."""
    for path in DOCS:
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if not re.match(r"^(https?:|mailto:|#)", target):
                assert (path.parent / target.split("#")[0]).exists(), f"{path.name}: broken link {target}"


def test_every_page_is_in_the_site_and_the_readme_is_short() -> None:
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    listed = {page for entry in nav for page in entry.values()}
    assert listed == {p.name for p in PAGES}
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail into docs/"
    assert "| tier | tests | time |" in lines  # the Tests table the test command's tiers fill


def test_every_api_reference_resolves() -> None:
    """docs/api.md's ``::: name`` entries exist (else mkdocstrings fails the site build)."""
    names = re.findall(r"^::: (\S+)$", (REPO / "docs" / "api.md").read_text(), re.M)
    assert "lightning_gaudi_ds.HPUDeepSpeedStrategy" in names
    for name in names:
        module, _, attr = name.rpartition(".")
        with _environ_kept():  # a first `import lightning` sets two of torch's variables (tests/test_environ.py)
            try:
                importlib.import_module(name)
            except ModuleNotFoundError:
                assert hasattr(importlib.import_module(module), attr), name


@pytest.mark.multiprocess
def test_site_builds_strictly_and_a_broken_link_fails(tmp_path: Path) -> None:
    """scripts/docs.sh's build (mkdocs --strict), on a copy: as it is, then with one broken link to a repo file."""
    import shutil

    for name in ("docs", "benchmarks", "lightning_gaudi_ds", "scripts"):
        shutil.copytree(REPO / name, tmp_path / name, ignore=shutil.ignore_patterns("raw", "__pycache__"))
    shutil.copy(REPO / "mkdocs.yml", tmp_path)
    build = [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")]
    run_job(build, timeout=300, cwd=tmp_path, env={"NO_MKDOCS_2_WARNING": "1"}).check()
    assert (tmp_path / "site" / "repo" / "benchmarks" / "results" / "planner.png").is_file()  # a linked repo file
    assert "lightning_gaudi_ds.HPUDeepSpeedStrategy" in (tmp_path / "site" / "api" / "index.html").read_text()
    page = tmp_path / "docs" / "limits.md"
    page.write_text(page.read_text() + "\n[gone](../benchmarks/results/no_such_table.md)\n")
    broken = run_job(build, timeout=300, cwd=tmp_path, env={"NO_MKDOCS_2_WARNING": "1"})
    assert broken.returncode != 0 and "no_such_table.md" in broken.output, broken.output[-2000:]
