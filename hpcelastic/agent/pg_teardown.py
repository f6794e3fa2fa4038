"""A warm worker's ``destroy_process_group`` lets gloo's threads finish before the process group can die.

DDP's reducer holds its process group, and its Python binding frees it holding the GIL (pytorch#56297):
when the script's ``ddp`` is freed after ``destroy_process_group`` (it is usually a local of ``main``),
``ProcessGroupGloo``'s destructor joins its threads with the GIL held. A thread still dropping the last
collective's work (a DCP or object collective's tensors, owned by Python objects) waits for the GIL to
free them: the worker hangs at exit, after its training ended. Measured on the DDP script saving through
DCP (tests/faults/slow_train.py ``--ddp-outlives-group``): 1 exit in 8 hung under torchrun with the Flight
Recorder on, 11 in 20 under ``hpcelastic run`` with slow-node detection on (which turns the recorder on),
0 in 20 with this wrap. A timing mitigation: a gloo thread kept off the CPU for longer than
:data:`SETTLE_S` could still hang; the cure is in torch (the reducer freeing its group without the GIL).

:func:`install` (in a warm-started worker, before its script runs) wraps ``destroy_process_group`` so that,
after it, the worker sleeps :data:`SETTLE_S` with the GIL released: a gloo thread waiting for the GIL takes
it then and drops its work, and the later destructor finds every thread idle. A cold-started worker runs
the script as torchrun would, unchanged.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable
from typing import Any

#: How long a worker sleeps after ``destroy_process_group`` (GIL released): a gloo thread needs it once.
SETTLE_S = 0.1
_MARK = "__hpcelastic_settles__"


def settling(destroy: Callable[..., Any], settle_s: float = SETTLE_S) -> Callable[..., Any]:
    """``destroy`` followed by a sleep of ``settle_s`` (the GIL released), once however often wrapped."""
    if getattr(destroy, _MARK, False):
        return destroy

    @functools.wraps(destroy)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        try:
            return destroy(*args, **kwargs)
        finally:
            time.sleep(settle_s)

    setattr(destroy_process_group, _MARK, True)
    return destroy_process_group


def install() -> bool:
    """Wrap ``torch.distributed.destroy_process_group`` (both names a script may import it by) if torch's
    distributed package is already imported (a warm start); whether it did."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    dist = sys.modules.get("torch.distributed")
    if c10d is None or dist is None or not hasattr(c10d, "destroy_process_group"):
        return False
    wrapped = settling(c10d.destroy_process_group)
    c10d.destroy_process_group = wrapped
    dist.destroy_process_group = wrapped
    return True
