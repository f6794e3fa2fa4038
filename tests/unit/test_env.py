"""Environment detection from real environment dictionaries (as srun, mpirun and `run` set them)."""

from __future__ import annotations

import socket
import time

import pytest

from hpcelastic.env import LocalEnvironment, MPIEnvironment, SlurmEnvironment, detect_environment
from hpcelastic.env import slurm as slurm_env
from hpcelastic.env.base import BootstrapOptions, parse_endpoint, visible_gpus
from hpcelastic.env.slurm import coordinator_file
from hpcelastic.errors import UserError
from hpcelastic.rundir import RunDir

SRUN = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "gpu[001-003,010]",
    "SLURM_STEP_NUM_NODES": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_NODEID": "2",
    "SLURM_RESTART_COUNT": "1",
    "SLURM_GPUS_ON_NODE": "4",
    "CUDA_VISIBLE_DEVICES": "0,1,2,3",
}


def test_slurm_step_context() -> None:
    env = detect_environment(SRUN)
    assert isinstance(env, SlurmEnvironment)
    ctx = env.context()
    assert ctx.hosts == ("gpu001", "gpu002", "gpu003", "gpu010")
    assert (ctx.node_rank, ctx.num_nodes, ctx.host) == (2, 4, "gpu003")
    assert (ctx.job_id, ctx.restart_count, ctx.gpus) == ("4242", 1, ("0", "1", "2", "3"))


def test_slurm_odd_hostlists_expand() -> None:
    ctx = SlurmEnvironment(
        {**SRUN, "SLURM_STEP_NODELIST": "b04-[09-10],a[1,2]-ib", "SLURM_NODEID": "0"}
    ).context()
    assert ctx.hosts == ("b04-09", "b04-10", "a1-ib", "a2-ib")


def test_slurm_gpus_from_count_when_cuda_visible_devices_unset() -> None:
    env = {k: v for k, v in SRUN.items() if k != "CUDA_VISIBLE_DEVICES"}
    assert SlurmEnvironment(env).context().gpus == ("0", "1", "2", "3")
    assert SlurmEnvironment({**env, "SLURM_GPUS_ON_NODE": ""}).context().gpus == ()


def test_slurm_several_tasks_per_node_is_a_user_error() -> None:
    with pytest.raises(UserError, match="ntasks-per-node=1"):
        SlurmEnvironment({**SRUN, "SLURM_STEP_NUM_TASKS": "8"}).context()


def test_slurm_rendezvous_needs_the_secret(tmp_path) -> None:
    env = SlurmEnvironment({**SRUN, "SLURM_NODEID": "1"})
    with pytest.raises(UserError, match="secret"):
        env.rendezvous(env.context(), BootstrapOptions(run_dir=tmp_path))
    RunDir(tmp_path).create_secret()
    rdzv = env.rendezvous(env.context(), BootstrapOptions(run_dir=tmp_path, endpoint="localhost:29400"))
    assert (rdzv.host, rdzv.port) == ("localhost", 29400)


def test_slurm_agents_find_the_coordinator_where_it_publishes_itself(tmp_path) -> None:
    """Group rank 0 listens on a free port and publishes address and port per job id and restart count;
    the others read them there without resolving a node name (gpu001 is in no DNS here)."""
    RunDir(tmp_path).create_secret()
    head = SlurmEnvironment({**SRUN, "SLURM_NODEID": "0"})
    rdzv0 = head.rendezvous(head.context(), BootstrapOptions(run_dir=tmp_path))
    assert rdzv0.listener is not None
    try:
        assert rdzv0.port == rdzv0.listener.getsockname()[1] and rdzv0.master_addr == rdzv0.host
        assert coordinator_file(RunDir(tmp_path), "4242", 1).exists()
        other = SlurmEnvironment({**SRUN, "SLURM_NODEID": "2"})
        rdzv2 = other.rendezvous(other.context(), BootstrapOptions(run_dir=tmp_path, timeout=2))
        assert (rdzv2.host, rdzv2.port, rdzv2.listener) == (rdzv0.host, rdzv0.port, None)
        # A later allocation (restart count 2) does not take this one's address.
        again = SlurmEnvironment({**SRUN, "SLURM_NODEID": "2", "SLURM_RESTART_COUNT": "2"})
        with pytest.raises(UserError, match="did not appear within 1 s"):
            again.rendezvous(again.context(), BootstrapOptions(run_dir=tmp_path, timeout=1))
    finally:
        rdzv0.listener.close()


def test_slurm_coordinator_that_cannot_listen_ends_every_agent_with_its_error(tmp_path) -> None:
    RunDir(tmp_path).create_secret()
    taken = socket.socket()
    taken.bind(("", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        head = SlurmEnvironment({**SRUN, "SLURM_NODEID": "0"})
        with pytest.raises(UserError, match=f"cannot listen on \\*:{port}"):
            head.rendezvous(head.context(), BootstrapOptions(run_dir=tmp_path, port=port))
        other = SlurmEnvironment({**SRUN, "SLURM_NODEID": "1"})
        t0 = time.monotonic()
        with pytest.raises(UserError, match="coordinator on gpu001 did not start: cannot listen"):
            other.rendezvous(other.context(), BootstrapOptions(run_dir=tmp_path, port=port, timeout=60))
        assert time.monotonic() - t0 < 2
    finally:
        taken.close()


def test_slurm_rendezvous_endpoint_that_does_not_resolve_is_a_user_error(tmp_path) -> None:
    RunDir(tmp_path).create_secret()
    env = SlurmEnvironment({**SRUN, "SLURM_NODEID": "1"})
    with pytest.raises(UserError, match="'no-such-host.invalid' does not resolve"):
        env.rendezvous(
            env.context(), BootstrapOptions(run_dir=tmp_path, endpoint="no-such-host.invalid:29400")
        )


def test_mpi_detected_from_launcher_variables_before_import() -> None:
    assert isinstance(
        detect_environment({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}), MPIEnvironment
    )
    assert isinstance(detect_environment({"PMI_SIZE": "2", "PMI_RANK": "1"}), MPIEnvironment)
    # srun --mpi=pmi2 also sets PMI_SIZE: the Slurm step wins.
    assert isinstance(detect_environment({**SRUN, "PMI_SIZE": "4"}), SlurmEnvironment)


def test_local_environment_and_default() -> None:
    env = detect_environment({"HPCELASTIC_LOCAL_NODE_RANK": "1", "HPCELASTIC_LOCAL_NUM_NODES": "3", **SRUN})
    assert isinstance(env, LocalEnvironment)
    ctx = env.context()
    assert (ctx.node_rank, ctx.num_nodes, ctx.hosts) == (1, 3, ("local0", "local1", "local2"))
    assert ctx.gpus == ("1",)  # four visible GPUs shared out over three local nodes, one each
    alone = detect_environment({})
    assert isinstance(alone, LocalEnvironment) and alone.context().num_nodes == 1


def test_forced_environment() -> None:
    assert isinstance(detect_environment({**SRUN, "HPCELASTIC_ENVIRONMENT": "local"}), LocalEnvironment)
    with pytest.raises(UserError, match="not one of"):
        detect_environment({"HPCELASTIC_ENVIRONMENT": "k8s"})


@pytest.mark.parametrize(
    ("text", "expected"),
    [("node1:29400", ("node1", 29400)), ("10.0.0.1:80", ("10.0.0.1", 80)), ("[fe80::1]:5", ("fe80::1", 5))],
)
def test_parse_endpoint(text: str, expected: tuple[str, int]) -> None:
    assert parse_endpoint(text) == expected


@pytest.mark.parametrize("text", ["node1", "node1:", ":80", "node1:99999", "a b:1", "node1:0"])
def test_unparsable_endpoint_names_the_problem(text: str) -> None:
    with pytest.raises(UserError, match="HOST:PORT"):
        parse_endpoint(text)


def test_visible_gpus() -> None:
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb"}) == ("GPU-aa", "GPU-bb")
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == ()
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}) == ()
    assert visible_gpus({}) == ()


def test_slurm_facts_come_from_one_table() -> None:
    facts = slurm_env.read({**SRUN, "SLURM_STEP_GPUS": "4,5,6,7", "SLURM_JOBID": "1"})
    assert (facts.job_id, facts.node_id, facts.step_num_nodes, facts.restart_count) == ("4242", 2, 4, 1)
    assert (facts.gpus_on_node, facts.step_gpus, facts.array_job_id) == (4, "4,5,6,7", None)
    assert slurm_env.read({"SLURM_JOBID": "7"}).job_id == "7"  # the older spelling, as a fallback
    with pytest.raises(UserError, match="SLURM_NODEID='٣' is not an integer"):
        slurm_env.read({**SRUN, "SLURM_NODEID": "٣"})


def test_slurm_context_job_id_is_the_array_aware_one() -> None:
    ctx = SlurmEnvironment({**SRUN, "SLURM_ARRAY_JOB_ID": "4200", "SLURM_ARRAY_TASK_ID": "3"}).context()
    assert (
        ctx.job_id == slurm_env.job_id({"SLURM_ARRAY_JOB_ID": "4200", "SLURM_ARRAY_TASK_ID": "3"}) == "4200_3"
    )


def test_slurm_restart_count_is_strict_in_the_context_and_lenient_alone() -> None:
    with pytest.raises(UserError, match="SLURM_RESTART_COUNT='x' is not an integer"):
        SlurmEnvironment({**SRUN, "SLURM_RESTART_COUNT": "x"}).context()
    assert slurm_env.restart_count({"SLURM_RESTART_COUNT": "x"}) == 0


@pytest.mark.parametrize(
    ("extra", "nvml"),
    [
        ({"SLURM_STEP_GPUS": "4,5,6,7", "SLURM_JOB_GPUS": "0,1,2,3,4,5,6,7"}, ("4", "5", "6", "7")),
        ({"SLURM_JOB_GPUS": "2,3,4,5"}, ("2", "3", "4", "5")),
        ({"SLURM_STEP_GPUS": "4,5"}, ("0", "1", "2", "3")),  # counts disagree: the visible ids
        ({}, ("0", "1", "2", "3")),
    ],
)
def test_slurm_nvml_gpu_ids(extra: dict[str, str], nvml: tuple[str, ...]) -> None:
    ctx = SlurmEnvironment({**SRUN, **extra}).context()
    assert (ctx.gpus, ctx.nvml_gpu_ids) == (("0", "1", "2", "3"), nvml)


def test_other_environments_report_the_visible_ids_to_nvml() -> None:
    ctx = LocalEnvironment({"CUDA_VISIBLE_DEVICES": "2,3", "SLURM_STEP_GPUS": "6,7"}).context()
    assert ctx.nvml_gpu_ids == ctx.gpus == ("2", "3")


def test_mpi_job_id_is_slurms_array_aware_one(monkeypatch: pytest.MonkeyPatch) -> None:
    class Comm:
        def Get_rank(self) -> int:
            return 0

        def Get_size(self) -> int:
            return 1

    monkeypatch.setattr("hpcelastic.env.mpi._comm", lambda: Comm())
    monkeypatch.setattr("hpcelastic.env.mpi.allgather_hostnames", lambda comm, name: ("h0",))
    environ = {"OMPI_COMM_WORLD_SIZE": "1", "SLURM_ARRAY_JOB_ID": "9", "SLURM_ARRAY_TASK_ID": "1"}
    ctx = MPIEnvironment({**environ, "SLURM_JOB_ID": "12", "SLURM_RESTART_COUNT": "2"}).context()
    assert (ctx.job_id, ctx.restart_count) == ("9_1", 2)


def test_worker_environ_drops_open_mpi_and_mpich_launcher_variables() -> None:
    launcher = {
        "OMPI_COMM_WORLD_RANK": "1",
        "PMIX_RANK": "1",
        "PMI_RANK": "1",
        "PMI_SIZE": "2",
        "HYDRA_CONTROL_FD": "9",
        "MPI_LOCALRANKID": "0",
        "MPI_LOCALNRANKS": "1",
        "HPCELASTIC_LOCAL_NODE_RANK": "0",
        "HPCELASTIC_COORDINATOR_FD": "5",
    }
    kept = {"PATH": "/bin", "NCCL_DEBUG": "INFO", "SLURM_JOB_ID": "3", "MPI_HOME": "/opt/mpi"}
    assert LocalEnvironment({**launcher, **kept}).worker_environ() == kept


def test_task_rank() -> None:
    assert slurm_env.task_rank({"SLURM_PROCID": "3"}) == 3
    assert slurm_env.task_rank({}) == slurm_env.task_rank({"SLURM_PROCID": "x"}) == 0
