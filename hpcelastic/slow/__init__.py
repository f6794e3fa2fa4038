"""Slow nodes (issue 28): the job's pace, which node holds it back and why, and what to do about it.

``verdict``: the facts the detector hands the policy; ``arrivals``: in each warm-started worker, when it
issued its recent collectives (Flight Recorder); ``collect``/``sample``: the agent's report of its ranks
(``cpu_throttle``: their CPU quota's throttling, ``input_watch``: their stacks in data loading);
``pace``/``locate``: pure detection from what the agents report, aggregated by the coordinator's
``detector``; ``policy``: the pure decision ladder (report, swap for a spare, exclude at a requeue).
"""
