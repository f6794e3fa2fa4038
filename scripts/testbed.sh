#!/usr/bin/env bash
# A real Slurm cluster on one machine, for hpcelastic's tests: slurmctld plus four
# slurmd daemons (node1..node4, `slurmd -N`), each node with 4 fake GPUs (character
# device files made with mknod) so Slurm sets CUDA_VISIBLE_DEVICES/SLURM_STEP_GPUS.
#
#   scripts/testbed.sh install   apt packages (slurm-wlm, munge); idempotent
#   scripts/testbed.sh up        write the config, start munge + daemons, wait until idle
#   scripts/testbed.sh down      stop the daemons (keeps the config)
#   scripts/testbed.sh status    scontrol ping + sinfo
#
# Node names resolve to their own loopback address (node1 -> 127.0.1.1, ...) through
# /etc/hosts, so every emulated node has its own IP, like a real cluster.
# Needs root (it writes /etc/slurm and /etc/hosts): run it on a throw-away machine or CI.
set -euo pipefail

NODES=${TESTBED_NODES:-4}
GPUS=${TESTBED_GPUS_PER_NODE:-4}
CPUS=${TESTBED_CPUS_PER_NODE:-8}
CONF_DIR=/etc/slurm
STATE=/var/lib/hpcelastic-testbed
LOGS=/var/log/hpcelastic-testbed
DEVS=$STATE/dev
CRED_EXPIRE=${TESTBED_CRED_EXPIRE:-10}

log() { printf 'testbed: %s\n' "$*" >&2; }

need_root() {
  if [ "$(id -u)" != 0 ]; then
    log "must run as root (it writes /etc/slurm and /etc/hosts)"
    exit 2
  fi
}

install_packages() {
  need_root
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
     && command -v sbatch >/dev/null; then
    return 0
  fi
  log "installing slurm-wlm and munge from Debian"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
}

write_hosts() {
  local i
  for i in $(seq 1 "$NODES"); do
    if ! grep -qE "^127\.0\.1\.$i[[:space:]]+node$i\$" /etc/hosts; then
      # /etc/hosts may be a bind mount: rewrite it in place rather than replacing the file.
      local kept
      kept=$(grep -vE "[[:space:]]node$i\$" /etc/hosts || true)
      printf '%s\n127.0.1.%s node%s\n' "$kept" "$i" "$i" >/etc/hosts
    fi
  done
}

make_fake_gpus() {
  local i g
  for i in $(seq 1 "$NODES"); do
    mkdir -p "$DEVS/node$i"
    for g in $(seq 0 $((GPUS - 1))); do
      [ -c "$DEVS/node$i/nvidia$g" ] || mknod "$DEVS/node$i/nvidia$g" c 195 "$g"
    done
  done
}

write_config() {
  local host i
  host=$(hostname -s)
  mkdir -p "$CONF_DIR" "$STATE/ctld" "$LOGS"
  {
    echo "# Written by hpcelastic scripts/testbed.sh: a test cluster on one host."
    echo "ClusterName=testbed"
    echo "SlurmctldHost=$host(127.0.0.1)"
    echo "SlurmctldPort=6817"
    echo "SlurmUser=root"
    echo "AuthType=auth/munge"
    echo "CredType=cred/munge"
    # Requeued jobs are eligible again only after cred_expire: keep it short for tests.
    echo "AuthInfo=cred_expire=$CRED_EXPIRE"
    echo "StateSaveLocation=$STATE/ctld"
    echo "SlurmdSpoolDir=$STATE/spool/%n"
    echo "SlurmctldPidFile=/run/slurmctld-testbed.pid"
    echo "SlurmdPidFile=/run/slurmd-testbed-%n.pid"
    echo "SlurmctldLogFile=$LOGS/slurmctld.log"
    echo "SlurmdLogFile=$LOGS/slurmd-%n.log"
    echo "SlurmctldDebug=info"
    echo "SlurmdDebug=info"
    # No cgroups in containers: track processes by parentage.
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "AccountingStorageType=accounting_storage/none"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_Core"
    echo "SchedulerType=sched/backfill"
    echo "GresTypes=gpu"
    # Let each emulated node declare more CPUs than the host has.
    echo "SlurmdParameters=config_overrides"
    echo "MpiDefault=none"
    echo "ReturnToService=2"
    echo "JobRequeue=1"
    echo "KillWait=10"
    echo "MinJobAge=3600"
    echo "MessageTimeout=20"
    echo "SlurmdTimeout=60"
    echo "InactiveLimit=0"
    echo "Waittime=0"
    for i in $(seq 1 "$NODES"); do
      echo "NodeName=node$i NodeHostname=$host NodeAddr=127.0.1.$i Port=$((17000 + i)) CPUs=$CPUS RealMemory=4000 Gres=gpu:$GPUS State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=node[1-$NODES] Default=YES MaxTime=INFINITE State=UP"
  } >"$CONF_DIR/slurm.conf"
  {
    for i in $(seq 1 "$NODES"); do
      echo "NodeName=node$i Name=gpu File=$DEVS/node$i/nvidia[0-$((GPUS - 1))]"
    done
  } >"$CONF_DIR/gres.conf"
  # No cgroup.conf: Slurm 22.05 then uses its defaults, which work in containers
  # (a "CgroupPlugin=disabled" line is 23.x syntax and makes 22.05 slurmd fail).
  rm -f "$CONF_DIR/cgroup.conf"
}

start_munge() {
  if pgrep -x munged >/dev/null; then
    return 0
  fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  chmod 0755 /run/munge
  if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
  fi
  runuser -u munge -- /usr/sbin/munged
}

wait_for() {
  local what=$1 tries=$2
  shift 2
  local n=0
  until "$@" >/dev/null 2>&1; do
    n=$((n + 1))
    if [ "$n" -ge "$tries" ]; then
      log "timed out waiting for $what"
      return 1
    fi
    sleep 0.5
  done
}

all_nodes_idle() {
  local ready
  ready=$(sinfo -h -N -o '%N %T' 2>/dev/null | grep -cE ' (idle|mixed|allocated)$' || true)
  [ "$ready" -ge "$NODES" ]
}

up() {
  need_root
  install_packages
  write_hosts
  make_fake_gpus
  write_config
  start_munge
  local i
  mkdir -p "$STATE/ctld"
  for i in $(seq 1 "$NODES"); do mkdir -p "$STATE/spool/node$i"; done
  if ! pgrep -x slurmctld >/dev/null; then
    # A fresh start clears the saved state (-c): jobs of an earlier, killed testbed must not
    # come back and hold nodes while the tests run.
    log "starting slurmctld"
    slurmctld -c
  fi
  wait_for "slurmctld" 60 scontrol ping
  for i in $(seq 1 "$NODES"); do
    if ! pgrep -f "slurmd -N node$i\$" >/dev/null; then
      slurmd -N "node$i"
    fi
  done
  wait_for "all $NODES nodes to be idle" 120 all_nodes_idle || { sinfo -N >&2; exit 1; }
  # Nodes left DOWN/DRAIN by an earlier run (e.g. a killed slurmd) come back here.
  scontrol update NodeName="node[1-$NODES]" State=RESUME >/dev/null 2>&1 || true
  log "up: $NODES nodes x $GPUS GPUs, partition debug ($(sinfo -h -o '%D nodes %T' | tr '\n' ' '))"
}

down() {
  pkill -x slurmd 2>/dev/null || true
  pkill -x slurmctld 2>/dev/null || true
  local n=0
  while pgrep -x slurmd >/dev/null || pgrep -x slurmctld >/dev/null; do
    n=$((n + 1))
    [ "$n" -gt 40 ] && { pkill -9 -x slurmd || true; pkill -9 -x slurmctld || true; }
    sleep 0.25
  done
  log "down"
}

status() {
  scontrol ping && sinfo -N -o '%N %T %G'
}

case "${1:-}" in
  install) install_packages ;;
  up) up ;;
  down) down ;;
  restart) down; up ;;
  status) status ;;
  *)
    echo "usage: $0 install|up|down|restart|status" >&2
    exit 2
    ;;
esac
