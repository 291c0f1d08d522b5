"""Progress bars when tqdm is installed (the ``bench``/``hf`` extras), plain iteration otherwise."""
from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], desc: str, total: int | None = None, enabled: bool = True) -> Iterator[T]:
    """Iterate ``items`` with a tqdm bar on stderr (if available and ``enabled``)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # the core depends on numpy and pluggy only
        yield from items
        return
    yield from tqdm(items, desc=desc, total=total, disable=not enabled, file=sys.stderr, leave=False)
