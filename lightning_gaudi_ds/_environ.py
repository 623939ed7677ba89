"""The one way the package writes ``os.environ`` in the user's process: for the duration of one library call.

Importing or training with the package leaves ``os.environ`` as it was. A variable is set only around a call into a
library that reads it and has no argument for it, and is put back afterwards. What ranks need for their whole life
is exported by the launcher that starts them, in their own (new) environment.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping


@contextlib.contextmanager
def scoped_environ(values: Mapping[str, str], override: bool = False) -> Iterator[dict[str, str]]:
    """Set ``values`` in ``os.environ`` for the ``with`` block (only the unset ones, unless ``override``) and yield
    what was set; afterwards each key set here is as it was before, whatever the block did to it."""
    before = {key: os.environ.get(key) for key in values if override or key not in os.environ}
    os.environ.update({key: values[key] for key in before})
    try:
        yield {key: values[key] for key in before}
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
