"""What happened to a run, read from its event log: ``status`` (the timeline and outcome), ``ledger``
(where the allocated time went; torchft replica groups are its per-group lanes, ``replica_lanes``),
``report`` (the HTML page), ``metrics`` (OpenMetrics), ``runindex`` (job id -> run directory), and
``fields`` (reading a record's fields). Pure over the log except where a module says otherwise."""
