"""Slow nodes (issue 28): the job's pace, which node holds it back and why, and what to do about it.

``verdict``: the facts the detector hands the policy; ``pace``/``locate``: pure detection from what the
agents report; ``policy``: the pure decision ladder (report, swap for a spare, exclude at a requeue).
"""
