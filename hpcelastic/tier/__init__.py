"""The node-local checkpoint tier: checkpoints in node memory (or local disk), replicated to peer nodes,
persisted to the shared checkpoint directory in the background, restored from the nearest copy.

- :mod:`~hpcelastic.tier.settings`: the tier's settings (site keys ``checkpoint_tier.*``), checked at
  submit and, for what only a node can tell (the local directory, its filesystem, its size), at agent start.
- :mod:`~hpcelastic.tier.scan`: which checkpoints in a node's local directory are complete, on evidence only
  (the format's own end, or the script's behaviour).
- :mod:`~hpcelastic.tier.step_clock`: each warm-started worker's last optimizer step (that behaviour).
- :mod:`~hpcelastic.tier.channel`: the data channel between agents (authenticated, throttled, bounded,
  retried) that carries replicas and restores.
- :mod:`~hpcelastic.tier.book`: the coordinator's view of every checkpoint (pure): when one is complete
  job-wide, who holds each node's part, what each node restores from.
- :mod:`~hpcelastic.tier.node`: the agent's side: the directory, the scans, the copies on a thread.
"""
