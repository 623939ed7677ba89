"""Re-create ``pride_and_prejudice.txt`` from Debian's ``r-cran-janeaustenr`` package (no R needed).

    apt-get download r-cran-janeaustenr && dpkg-deb -x r-cran-janeaustenr_*.deb pkg
    python examples/data/extract_janeaustenr.py pkg/usr/lib/R/site-library/janeaustenr/data prideprejudice > out.txt

The package stores each novel as an R character vector (one element per line) in an R lazy-load database:
``Rdata.rdx`` (gzip'd index) and ``Rdata.rdb`` (zlib'd objects, each after a 4-byte length), both in R's XDR
serialization format. This reader handles only what that database holds.
"""

from __future__ import annotations

import gzip
import struct
import sys
import zlib
from pathlib import Path
from typing import Any

NIL, SYM, LIST, CHAR, LGL, INT, REAL, STR, VEC, REF = 254, 1, 2, 9, 10, 13, 14, 16, 19, 255


class _Reader:
    def __init__(self, data: bytes) -> None:
        if data[:2] != b"X\n":
            raise ValueError("not R's XDR serialization format")
        self.data, self.pos, self.refs = data, 2, []
        version = self._int()
        self.pos += 8  # writer and minimal reader R versions
        if version == 3:
            self.pos += 4 + self._peek_int()  # native encoding name

    def _peek_int(self) -> int:
        return struct.unpack(">i", self.data[self.pos : self.pos + 4])[0]

    def _int(self) -> int:
        value = self._peek_int()
        self.pos += 4
        return value

    def _numbers(self, fmt: str, size: int) -> list[Any]:
        n = self._int()
        values = list(struct.unpack(f">{n}{fmt}", self.data[self.pos : self.pos + size * n]))
        self.pos += size * n
        return values

    def read(self) -> Any:
        flags = self._int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind == NIL or kind in (242, 251, 253):
            return None
        if kind == REF:
            return self.refs[(flags >> 8 or self._int()) - 1]
        if kind == CHAR:
            n = self._int()
            text = None if n == -1 else self.data[self.pos : self.pos + n].decode("utf-8")
            self.pos += max(n, 0)
            return text
        if kind == SYM:
            self.refs.append(("symbol", self.read()))
            return self.refs[-1]
        if kind == LIST:  # pairlist -> dict keyed by tag
            out: dict[Any, Any] = {}
            while kind == LIST:
                if has_attr:
                    self.read()
                tag = self.read() if has_tag else None
                out[tag[1] if tag else len(out)] = self.read()
                flags = self._int()
                kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
            return out
        if kind in (STR, VEC):
            values: Any = [self.read() for _ in range(self._int())]
        elif kind in (LGL, INT):
            values = self._numbers("i", 4)
        elif kind == REAL:
            values = self._numbers("d", 8)
        else:
            raise ValueError(f"unsupported R type {kind}")
        if has_attr:
            attributes = self.read()
            if kind == VEC and "names" in attributes:
                values = dict(zip(attributes["names"], values))
        return values


def read_lazyload_db(directory: Path, name: str) -> list[str]:
    """The character vector ``name`` from ``directory``/Rdata.rdx|rdb."""
    index = _Reader(gzip.decompress((directory / "Rdata.rdx").read_bytes())).read()
    offset, length = (int(v) for v in index["variables"][name])
    raw = (directory / "Rdata.rdb").read_bytes()[offset : offset + length]
    return [line or "" for line in _Reader(zlib.decompress(raw[4:])).read()]


if __name__ == "__main__":
    sys.stdout.write("\n".join(read_lazyload_db(Path(sys.argv[1]), sys.argv[2])) + "\n")
