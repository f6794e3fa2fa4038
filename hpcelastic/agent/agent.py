"""The node agent: one per node. :func:`run_agent` bootstraps the node's runtime, then runs its loop.

See :mod:`hpcelastic.agent.bootstrap` (set-up), :mod:`hpcelastic.agent.runtime` (what the loop runs
on) and :mod:`hpcelastic.agent.loop` (the state machine). Group rank 0 also hosts the
:class:`~hpcelastic.agent.coordinator.Coordinator`.
"""

from __future__ import annotations

import contextlib

from hpcelastic.agent.bootstrap import bootstrap
from hpcelastic.agent.loop import NodeLoop
from hpcelastic.agent.spec import AgentSpec
from hpcelastic.env.base import Environment


def run_agent(env: Environment, spec: AgentSpec) -> int:
    """Run one agent to the end of its attempt and return its exit code."""
    with contextlib.ExitStack() as stack:
        runtime = bootstrap(env, spec, stack)
        if isinstance(runtime, int):
            return runtime
        return NodeLoop(runtime).run()
