"""Keep Python's cyclic garbage collector off the engine's per-step critical path.

Every step allocates container objects (scheduled requests, lists, sampled tokens), so the collector runs
often; now and then a full collection scans every tracked object in the process, model, tokenizer and torch
included: about 300,000 objects and 0.2 s on a small CPU for an `LLM` with the default model, paid inside
whichever step triggers it. On the CPU with a forward pass that costs nothing (`host_profile.py --null-model`),
such collections were 45 % of the host's time per step at 1,024 running requests.

`objects_frozen()` wraps a generation run: the objects that exist when it starts are moved out of the
collector's generations (`gc.freeze`) and moved back when the last run ends (`gc.unfreeze`), so collections
during the run scan only what the run created, and nothing is kept from collection once it returns. A process
that froze objects itself (a nonzero `gc.get_freeze_count()` at the start) is left to its own policy.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_active = 0  # runs inside objects_frozen (an LLM may stream from several threads)
_ours = False  # the freeze in place is this module's


@contextmanager
def objects_frozen() -> Iterator[None]:
    global _active, _ours
    with _lock:
        if _active == 0 and gc.get_freeze_count() == 0:
            gc.freeze()
            _ours = True
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0 and _ours:
                gc.unfreeze()
                _ours = False
