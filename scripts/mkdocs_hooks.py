"""MkDocs hook (mkdocs.yml): the pages link to files of the repository outside docs/ (benchmarks/README.md, the
results' tables and charts) by their relative paths, which work on GitHub too. Each such target that exists is
copied into the site under ``repo/`` as it is, so the link resolves there and ``--strict`` still fails on a link to
a file that does not exist.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files, InclusionLevel

_LINK = re.compile(r"\]\((\.\./[^)#\s]+)")


class _RepoFile(File):
    """A file of the repository copied verbatim (a markdown one too: it is not a page of the site)."""

    def is_documentation_page(self) -> bool:
        return False

    def is_media_file(self) -> bool:
        return True


def on_files(files: Files, config: Any) -> Files:
    docs = Path(config["docs_dir"]).resolve()
    repo = docs.parent
    targets = {m.group(1) for page in docs.rglob("*.md") for m in _LINK.finditer(page.read_text())}
    for target in sorted(targets):
        path = (docs / target).resolve()
        if path.is_file() and repo in path.parents and docs not in path.parents:
            rel = path.relative_to(repo).as_posix()
            file = _RepoFile(target, str(docs), config["site_dir"], config["use_directory_urls"])
            file.dest_uri = f"repo/{rel}"
            file.inclusion = InclusionLevel.INCLUDED  # a path starting with "." is excluded by default
            files.append(file)
    return files
