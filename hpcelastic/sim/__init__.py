"""A deterministic simulation of week-long jobs that drives hpcelastic's real decision code.

``python -m hpcelastic.sim --seed N`` replays one week; ``--weeks K`` runs many and checks the
invariants of :mod:`hpcelastic.sim.invariants` after every decision, round and attempt.
"""
