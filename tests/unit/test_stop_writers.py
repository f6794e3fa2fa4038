"""A stop waits for the whole job's checkpoint writers, not one node's (issue 27, item 7).

At a stop, a rank that finished its shard of a sharded save may still be needed by another node's ranks (DCP:
rank 0 gathers and writes ``.metadata`` last). Each agent reports its node's saves (``Saving``) while the stop
lasts; the coordinator tells every round node whether the job as a whole saves (``JobSaving``); an agent stops
a worker only once the whole job has been quiet for ``STOP_QUIET_S``.
"""

from __future__ import annotations

import math

from hpcelastic.agent import messages
from hpcelastic.agent.job_state import JobSaves, NodeSaves, job_saves
from hpcelastic.agent.loop import STOP_QUIET_S, quiet_enough
from tests.unit import test_replicas
from tests.unit.test_job_state import Clock, join_all, make, sends


def test_the_job_saves_while_any_node_does_and_is_quiet_since_the_latest_write() -> None:
    quiet, writing = NodeSaves(False, 10.0), NodeSaves(True, 12.0)
    assert job_saves({0: quiet}, [0, 1]) is None  # node 1 not heard from: it may be writing
    assert job_saves({0: quiet, 1: writing}, [0, 1]) == JobSaves(True)
    assert job_saves({0: quiet, 1: NodeSaves(False, 11.0)}, [0, 1]) == JobSaves(False, 11.0)
    assert job_saves({0: NodeSaves(False, None), 1: NodeSaves(False, None)}, [0, 1]) == JobSaves(False)
    assert job_saves({0: quiet, 1: writing}, [0]) == JobSaves(False, 10.0)  # node 1 takes no part now


def test_a_node_done_with_its_shard_waits_for_the_other_nodes_save() -> None:
    """Node 1 finished its shard, node 0 still writes: every node hears that the job saves, then, once
    node 0 closed its file, that the job is quiet and for how long; nothing is sent when nothing changed."""
    clock = Clock()
    st = make(2, clock=clock)
    join_all(st)
    st.preempt(1, "USR2")
    assert st.saving(1, 0, False, 0.1) == []  # node 0 not heard from yet
    told = sends(st.saving(0, 0, True, 0.0), "job_saving")
    assert told == {0: messages.JobSaving(0, True), 1: messages.JobSaving(0, True)}
    clock.t += 1.5
    assert st.saving(1, 0, False, 1.6) == []  # no change
    clock.t += 0.25
    told = sends(st.saving(0, 0, False, 0.2), "job_saving")
    assert sorted(told) == [0, 1]
    assert {(m.saving, round(m.quiet_s or -1, 6)) for m in told.values()} == {(False, 0.2)}
    assert st.saving(0, 1, True, 0.0) == []  # another round's report


def test_a_node_that_stopped_or_was_lost_no_longer_holds_the_job() -> None:
    clock = Clock()
    st = make(3, clock=clock)
    join_all(st)
    st.preempt(0, "USR2")
    st.saving(0, 0, False, None)
    st.saving(2, 0, True, 0.0)
    told = sends(st.lost(1, "connection closed"), "job_saving")
    assert {m.saving for m in told.values()} == {True} and sorted(told) == [0, 2]
    told = sends(st.workers_stopped(2, 0, []), "job_saving")
    assert told == {0: messages.JobSaving(0, False, None)}  # node 0 never saw a save


def test_with_replica_groups_each_node_hears_the_job_in_its_own_groups_round() -> None:
    st = test_replicas.make()
    r = test_replicas.start(st)
    st.worker_failed(3, r[3].round, [{"rank": 1, "error": "boom", "ts": 1000.0}])
    stopped = st.workers_stopped(2, r[2].round, []) + st.workers_stopped(3, r[3].round, [])
    again = test_replicas.rounds(stopped)
    now = {n: (again.get(n) or r[n]).round for n in range(4)}
    assert now[0] != now[2]  # group 1 restarted: a round of its own
    st.preempt(0, "USR2")
    for n in (1, 2, 3):
        assert st.saving(n, now[n], False, None) == []
    told = sends(st.saving(0, now[0], True, 0.0), "job_saving")
    assert told == {n: messages.JobSaving(now[n], True) for n in range(4)}


def test_a_worker_is_stopped_only_once_the_whole_job_was_quiet_long_enough() -> None:
    now = 100.0
    # This node quiet, but another node saves (or the coordinator has not answered yet): wait.
    assert not quiet_enough(now, None, None, coordinated=True)
    assert not quiet_enough(now, now - 5, None, coordinated=True)
    # The job quiet, but not for STOP_QUIET_S yet; then long enough; no save anywhere.
    assert not quiet_enough(now, None, now - STOP_QUIET_S / 2, coordinated=True)
    assert quiet_enough(now, None, now - STOP_QUIET_S, coordinated=True)
    assert quiet_enough(now, None, -math.inf, coordinated=True)
    # This node's own write counts at once, whatever the job's word.
    assert not quiet_enough(now, now - 0.1, -math.inf, coordinated=True)
    # No coordinator to ask (connection gone): this node's saves alone, as before.
    assert quiet_enough(now, now - STOP_QUIET_S, None, coordinated=False)
    assert not quiet_enough(now, now - 0.1, None, coordinated=False)


def test_messages_round_trip_and_old_fields_only_decode() -> None:
    for msg in (messages.Saving(3, True, 0.0), messages.Saving(3, False, None)):
        assert messages.decode(messages.FROM_AGENT, messages.encode(msg)) == msg
    for reply in (messages.JobSaving(3, True), messages.JobSaving(3, False, 0.7)):
        assert messages.decode(messages.FROM_COORDINATOR, messages.encode(reply)) == reply
    bare = {"t": "saving", "round": 3, "saving": False}
    assert messages.decode(messages.FROM_AGENT, bare) == messages.Saving(3, False, None)
