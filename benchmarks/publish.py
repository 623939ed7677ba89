"""Results are published only by a run that succeeded: each script writes its result files into a staging folder
beside them (:func:`staged`), and only when the run ends well does each file replace its namesake, by rename. A run
that fails (an exception, or :meth:`Stage.discard`) leaves the folder as it was: the committed results under
``benchmarks/results/`` never hold a failed run's rows."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class Stage:
    """A new folder (``path``) inside ``folder`` for one run's result files; see :func:`staged`."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.path = Path(tempfile.mkdtemp(prefix=".staging-", dir=folder))
        self.done = False

    def publish(self) -> list[Path]:
        """Move every file of the stage over its namesake in ``folder`` (each one atomically); the files moved."""
        moved = []
        for src in sorted(p for p in self.path.rglob("*") if p.is_file()):
            dest = self.folder / src.relative_to(self.path)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(src, dest)
            moved.append(dest)
        shutil.rmtree(self.path, ignore_errors=True)
        self.done = True
        return moved

    def discard(self, why: str, keep: bool = False) -> None:
        """Leave ``folder`` as it was (said on stderr, with ``why``); the staged files are removed, or with ``keep``
        moved to a new folder in the system's temp directory, for a look at a failed run's report."""
        if self.done:
            return
        where = ""
        if keep and any(self.path.iterdir()):
            kept = Path(tempfile.mkdtemp(prefix="benchmark-failed-"))
            for src in self.path.iterdir():
                os.replace(src, kept / src.name)
            where = f" This run's files are in {kept}."
        shutil.rmtree(self.path, ignore_errors=True)
        print(f"{why}: no results written; {self.folder} is as it was.{where}", file=sys.stderr)
        self.done = True


@contextmanager
def staged(folder: Path) -> Iterator[Stage]:
    """Write result files into ``stage.path``: when the block ends without an error (and without
    ``stage.discard``) they replace their namesakes in ``folder``; on an error nothing there changes."""
    stage = Stage(folder)
    try:
        yield stage
    except BaseException as err:
        stage.discard(f"the run failed ({type(err).__name__})")
        raise
    if not stage.done:
        stage.publish()


def write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` in one rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp's file is the owner's only; a results file is readable as any other
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def append_text(path: Path, text: str) -> None:
    """``path``'s text followed by ``text``, written as :func:`write_text` does."""
    write_text(path, (path.read_text() if path.exists() else "") + text)


def replace_section(readme: Path, name: str, body: str) -> None:
    """Replace what lies between ``<!-- name:start -->`` and ``<!-- name:end -->`` in ``readme`` with ``body`` (in one
    rename); a readme without both markers is left as it is."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = readme.read_text()
    if start in text and end in text:
        pre, rest = text.split(start, 1)
        write_text(readme, pre + start + "\n" + body + end + rest.split(end, 1)[1])


def report_only(script: str, out: Path, kind: str,
                write_report: Callable[[list[dict[str, Any]], dict[str, Any], Path], str],
                readme: Callable[[str], None] | None = None) -> int:
    """A benchmark's ``--report-only``: its report made again from ``out/<kind>.jsonl`` (the rows of type ``kind``
    and the run's meta row), published as a run's would be, and printed; with ``readme``, that is given the text.
    Returns the exit status: 2, saying so, where ``out`` holds no results."""
    results = out / f"{kind}.jsonl"
    if not results.is_file():
        print(f"{script} --report-only: no results to report in {out} (no {results.name}). Run {script} first, or"
              " pass --out with the folder of an earlier run.", file=sys.stderr)
        return 2
    lines = [json.loads(x) for x in results.read_text().splitlines()]
    meta = next(x for x in lines if x["type"] == "meta")
    with staged(out) as stage:
        text = write_report([x for x in lines if x["type"] == kind], meta, stage.path)
    if readme is not None:
        readme(text)
    print(text)
    return 0
