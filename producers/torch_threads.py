"""torch's intra-op threads while a generator samples: few, because its per-step ops are small.

Thread hand-offs cost more than they give on a busy 2-core box where the broker and the other
stages run beside the generator. ``torch_threads(n)`` sets them for the ``with`` block (n > 0; 0
keeps torch's default) and restores them after.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    if n > 0:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
