"""Hang detection without the worker API: stack sampling (py-spy), progress tracking and localization.

- :mod:`.stacks`: typed stacks (frames per thread) parsed from ``py-spy dump --json``, signatures.
- :mod:`.pyspy`: the I/O edge: run py-spy on a pid (stopped processes included), read ``/proc``.
- :mod:`.progress`: ``ProgressTracker``, a pure decision over periodic samples: which ranks stalled.
- :mod:`.localize`: ``localize(stacks_by_rank)``: the rank(s) outside the majority, and where they hang.
- :mod:`.store`: ``<run>/stacks/attempt-<K>/round-<R>.json``.

Nothing here imports torch.
"""
