#!/usr/bin/env bash
# A real Slurm cluster on one machine, for hpcelastic's tests: slurmctld plus four
# slurmd daemons (node1..node4, `slurmd -N`), each node with 4 fake GPUs (character
# device files made with mknod) so Slurm sets CUDA_VISIBLE_DEVICES/SLURM_STEP_GPUS.
#
#   scripts/testbed.sh install           apt packages (slurm-wlm, munge, nftables); idempotent
#   scripts/testbed.sh install-root      the Debian trixie root that runs Slurm 24.11 (TESTBED_SLURM);
#                                        built once (about 30-60 s, 250 MB), then reused; idempotent
#   scripts/testbed.sh image             podman (rootful, runc) and a local image without Slurm
#                                        (localhost/hpcelastic-testbed:trixie) that is also the rootfs of
#                                        the OCI bundle $TESTBED_ROOTS/oci-bundle; built once; idempotent
#   scripts/testbed.sh up                write the config, start munge + daemons, wait until idle
#                                        (an instance that is already running keeps its config)
#   scripts/testbed.sh down              stop this instance's daemons and its job processes (keeps the config)
#   scripts/testbed.sh status            its daemons' pids, scontrol ping, sinfo
#   scripts/testbed.sh env               the `export SLURM_CONF=...` line for this instance
#   scripts/testbed.sh kill-node NODE    the node dies as a whole: SIGKILL its slurmd and every process of
#                                        its jobs at once; prints the killed pids. Slurm marks it DOWN
#                                        after SlurmdTimeout (TESTBED_SLURMD_TIMEOUT) and acts on its jobs.
#   scripts/testbed.sh revive-node NODE  restart its slurmd and `scontrol update State=RESUME`
#   scripts/testbed.sh pids NODE         the pids kill-node would kill (nothing is killed)
#   scripts/testbed.sh addr NODE         the node's address (NodeAddr)
#
# Network faults, on instances up with TESTBED_NETNS=1 only (elsewhere: one-line error, exit 2). Each
# prints one line and returns at once; a timed fault ends itself from a detached background process.
# They drop or delay packets on the fabric side of the node's link: the node stays up, its processes
# run and see no error, its files (the shared filesystem) are untouched.
#   scripts/testbed.sh cut-link NODE [SECONDS]   every packet between NODE and anything else dropped,
#                                        both ways; for SECONDS (omitted or 0: until heal)
#   scripts/testbed.sh netem NODE ARGS...        `tc qdisc ... netem ARGS` on the node's link, both
#                                        directions (`loss 5%`, `delay 50ms 20ms`...); `netem NODE off`
#                                        removes it. On a kernel without sch_netem (this CI machine) only
#                                        `loss P%` (nftables) and `delay TIME [JITTER]` (uniform; iptables
#                                        NFQUEUE and a python3 process) are emulated; else exit 2.
#   scripts/testbed.sh partition NODE PEER...    NODE and each PEER (a node, or `slurmctld`) exchange
#                                        no packets, both ways; everything else still works
#   scripts/testbed.sh flap NODE DOWN_S UP_S COUNT   link cut for DOWN_S, up for UP_S, COUNT times
#   scripts/testbed.sh heal NODE         undo every fault of NODE now (cut, netem, partition, flap)
#   scripts/testbed.sh exec NODE CMD...  run CMD in the node's network namespace
#
# Instances: the testbed touches only the daemons it started (pid files in its state dir, each pid's
# command line checked before a signal). TESTBED_NAME picks the instance:
#   default  (TESTBED_NAME unset or "default"): /etc/slurm, /var/lib/hpcelastic-testbed, nodes node1..,
#            127.0.1.i, ports 6817 and 17001.. -- what the tests use.
#   NAME     (e.g. dev): /var/lib/hpcelastic-testbed-NAME/etc/slurm.conf, nodes NAME1.., addresses
#            127.0.I.i and ports 6817+100*(I-1), 17000+100*(I-1)+i with I = TESTBED_INDEX (default 2).
#            Point clients at it with `eval "$(TESTBED_NAME=NAME scripts/testbed.sh env)"`.
# Knobs (read when the config is written, i.e. on `up` of a stopped instance):
#   TESTBED_NODES (4), TESTBED_GPUS_PER_NODE (4), TESTBED_CPUS_PER_NODE (8), TESTBED_CRED_EXPIRE (10),
#   TESTBED_SLURMD_TIMEOUT (60): seconds without an answer from a slurmd before its node is DOWN,
#   TESTBED_UNRESOLVABLE: "1"/"all", or node names (comma/space separated) whose NodeName is kept
#            out of /etc/hosts; Slurm reaches them by NodeAddr only,
#   TESTBED_PREEMPT=1: add partition `urgent` (PriorityTier=10) over the same nodes, with
#            PreemptType=preempt/partition_prio and PreemptMode=REQUEUE: its jobs requeue `debug` jobs.
#   TESTBED_PREEMPT_GRACE=N (with TESTBED_PREEMPT=1): `debug` gets GraceTime=N and the cluster
#            SlurmctldParameters=preempt_send_user_signal (22.05; PreemptParameters= from 23.02),
#            as sites that let preempted jobs checkpoint configure it.
#   TESTBED_TASK_PLUGIN (task/none): Slurm's TaskPlugin, e.g. task/affinity (binds each task to its
#            CPUs), task/cgroup (a cpuset per step, cgroup.conf ConstrainCores=yes; works on this
#            machine's cgroup v1), or "task/cgroup,task/affinity". Binding uses the host's CPU ids:
#            TESTBED_CPUS_PER_NODE must then be <= the host's CPUs (nproc), or binding fails.
#   TESTBED_SLURM (22.05): which Slurm runs the instance: 22.05 is the host's (Debian bookworm);
#            24.11 runs from a Debian trixie root of its own under $TESTBED_ROOTS (default
#            /var/lib/hpcelastic-testbed-roots), with its own munged; its commands are wrappers in
#            the instance's state dir bin/, which `env` puts first on PATH (host 22.05 clients cannot
#            talk to a 24.11 slurmctld). See "A second Slurm" below.
#   TESTBED_OCI=1: Slurm's OCI support (`srun --container=BUNDLE`): an oci.conf running runc.
#   TESTBED_NETNS=1: each node gets a network of its own (stored in the state dir; later commands
#            of the instance go by it): its slurmd, and so every step and process of the node, runs in
#            network namespace hpce-NAME-NODE with address 198.18.I.i/24 (RFC 2544 benchmarking range)
#            on eth0, a veth to bridge hpcebrI (198.18.I.254) in the root namespace, where slurmctld
#            runs (SlurmctldHost=host(198.18.I.254)). No route beyond 198.18.I.0/24. munge and the
#            filesystem are shared (a socket path, files). `down` removes the namespaces (killing
#            what still runs there), veths, bridge, nftables tables and fault timers of the instance.
#            Needs nftables (`install` adds it). Node-to-node frames cross the bridge: a host whose
#            br_netfilter sends them through an iptables FORWARD chain that drops (a Docker host) cuts
#            the nodes off from each other; this CI machine loads no iptables table, so nothing drops.
#
# Node names resolve to their own loopback address (node1 -> 127.0.1.1, ...) or, with TESTBED_NETNS=1,
# their namespace's address through /etc/hosts, so every emulated node has its own IP, like a real cluster.
# Needs root (it writes /etc/slurm and /etc/hosts): run it on a throw-away machine or CI.
set -euo pipefail

NAME=${TESTBED_NAME:-default}
case "$NAME" in
  *[!a-z0-9]* | "")
    printf 'testbed: TESTBED_NAME must be lowercase letters and digits, not %q\n' "$NAME" >&2
    exit 2
    ;;
esac
NODES=${TESTBED_NODES:-4}
GPUS=${TESTBED_GPUS_PER_NODE:-4}
CPUS=${TESTBED_CPUS_PER_NODE:-8}
CRED_EXPIRE=${TESTBED_CRED_EXPIRE:-10}
SLURMD_TIMEOUT=${TESTBED_SLURMD_TIMEOUT:-60}
UNRESOLVABLE=${TESTBED_UNRESOLVABLE:-}
PREEMPT=${TESTBED_PREEMPT:-0}
PREEMPT_GRACE=${TESTBED_PREEMPT_GRACE:-0}
TASK_PLUGIN=${TESTBED_TASK_PLUGIN:-task/none}
OCI=${TESTBED_OCI:-0}
if [ "$NAME" = default ]; then
  INDEX=1
  CONF_DIR=/etc/slurm
  STATE=/var/lib/hpcelastic-testbed
  LOGS=/var/log/hpcelastic-testbed
  PREFIX=node
  CLUSTER=testbed
else
  INDEX=${TESTBED_INDEX:-2}
  STATE=/var/lib/hpcelastic-testbed-$NAME
  CONF_DIR=$STATE/etc
  LOGS=/var/log/hpcelastic-testbed-$NAME
  PREFIX=$NAME
  CLUSTER=tb$NAME
fi
if [ "$INDEX" -lt 1 ] || [ "$INDEX" -gt 250 ]; then
  echo "testbed: TESTBED_INDEX must be 1..250" >&2
  exit 2
fi
CONF=$CONF_DIR/slurm.conf
CTLD_PORT=$((6817 + 100 * (INDEX - 1)))
NODE_PORT0=$((17000 + 100 * (INDEX - 1)))
DEVS=$STATE/dev
RUN=$STATE/run
# TESTBED_NETNS (and the index its addresses, bridge and veths are named by) is read on `up` of a
# stopped instance and stored here; every later command of the instance goes by the stored values.
NETNS_FILE=$STATE/netns
read -r NETNS NET_INDEX 2>/dev/null <"$NETNS_FILE" || true
NETNS=${NETNS:-0}
NET_INDEX=${NET_INDEX:-$INDEX}
FAULTS=$STATE/faults

set_net() { # the addresses of the current mode
  BRIDGE=hpcebr$NET_INDEX
  if [ "$NETNS" = 1 ]; then
    NET=198.18.$NET_INDEX
    CTLD_ADDR=$NET.254
  else
    NET=127.0.$INDEX
    CTLD_ADDR=127.0.0.1
  fi
}
set_net
export SLURM_CONF=$CONF

# Which Slurm runs the instance (TESTBED_SLURM, read on `up` of a stopped instance and stored like
# TESTBED_NETNS): the host's (Debian bookworm, 22.05) or 24.11 from a Debian trixie root of its own
# (see "A second Slurm" below). Each release maps to the Debian suite that ships it.
SLURM_FILE=$STATE/slurm
read -r SLURM_RELEASE 2>/dev/null <"$SLURM_FILE" || true
SLURM_RELEASE=${SLURM_RELEASE:-host}
ROOTS=${TESTBED_ROOTS:-/var/lib/hpcelastic-testbed-roots}
MIRROR=${TESTBED_MIRROR:-http://deb.debian.org/debian}
suite_of() { # RELEASE: the Debian suite of its root; nothing for the host's own Slurm
  case "$1" in
    host | 22.05) ;;
    24.11) echo trixie ;;
    *)
      printf 'testbed: TESTBED_SLURM must be 22.05 (the host'"'"'s) or 24.11, not %q\n' "$1" >&2
      exit 2
      ;;
  esac
}
set_release() { # the root (empty: the host's Slurm) and the wrappers' directory of SLURM_RELEASE
  SUITE=$(suite_of "$SLURM_RELEASE")
  ROOT=${SUITE:+$ROOTS/$SUITE}
  WRAPPERS=$STATE/bin
  # Another instance's wrappers on the caller's PATH would run the wrong release's commands.
  PATH=$(printf '%s' "$PATH" | tr ':' '\n' | grep -vE '/hpcelastic-testbed-[a-z0-9]+/bin$' | paste -sd: -)
  if [ -n "$ROOT" ] && [ -d "$WRAPPERS" ]; then PATH="$WRAPPERS:$PATH"; fi
  export PATH
}
set_release

log() { printf 'testbed[%s]: %s\n' "$NAME" "$*" >&2; }

need_root() {
  if [ "$(id -u)" != 0 ]; then
    log "must run as root (it writes $CONF_DIR and /etc/hosts)"
    exit 2
  fi
}

install_packages() {
  need_root
  if [ -n "$ROOT" ]; then
    build_root
    return 0
  fi
  # nft and iptables-legacy (the network faults) are needed by netns instances only.
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
     && command -v sbatch >/dev/null && { { [ "$NETNS" != 1 ] && [ "${TESTBED_NETNS:-0}" != 1 ]; } || { command -v nft && command -v iptables-legacy; } >/dev/null; }; then
    return 0
  fi
  log "installing slurm-wlm, munge, nftables and iptables from Debian"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurm-wlm munge nftables iptables >/dev/null
}

# --- A second Slurm: a Debian root of its own (TESTBED_SLURM=24.11) --------------------------------
# Host client commands cannot talk to a newer slurmctld, and two Slurm releases cannot share one
# /usr. So 24.11 runs from `debootstrap --variant=minbase trixie` in $ROOTS/trixie (built once and
# reused: `install-root`, or the first `up`), its daemons and every job under chroot: its own munged
# on its own /run (its own key), the instance's own ports and loopback addresses as any other
# instance. The host's /tmp, /root, /home, the repository (TESTBED_BINDS: more) and the instance's
# state and log directories are bind-mounted at the same paths, so the host's Python and the
# project's .venv run inside and a run directory has one path on both sides. $STATE/bin holds a
# wrapper per Slurm command that runs the root's command (chroot, same working directory); `env`
# puts it first on PATH, and inside the root (a job's processes) a wrapper runs the command directly.
# The root's packages: Slurm, munge, runc (Slurm's OCI mode), and the libraries the host Python's
# modules link to (ssl, ffi, sqlite, bz2, lzma, uuid, readline, libstdc++ for torch).
ROOT_PACKAGES="slurmctld slurmd slurm-client munge runc libssl3t64 libffi8 libsqlite3-0 libbz2-1.0 liblzma5 libuuid1 libreadline8t64 libncursesw6 libstdc++6"
ROOT_MARK=.hpcelastic-testbed-root
SLURM_COMMANDS="sbatch srun salloc scontrol squeue scancel sinfo sacct sattach sprio sstat sdiag scrun slurmctld slurmd munge unmunge"

mounts_under() { # DIR: mount points at or below DIR, deepest first
  awk -v d="$1" '{ gsub(/\\040/, " ", $5); if ($5 == d || index($5, d "/") == 1) print $5 }' /proc/self/mountinfo | sort -r
}

umount_under() { # DIR: unmount everything mounted at or below DIR; stops while any is left
  local m
  for m in $(mounts_under "$1"); do umount -l "$m" 2>/dev/null || true; done
  if [ -n "$(mounts_under "$1")" ]; then
    log "still mounted under $1: $(mounts_under "$1" | xargs); not touching it"
    exit 1
  fi
}

build_root() { # the Debian root of SLURM_RELEASE, built once (its mark names its suite and packages)
  local want tmp lock
  want="$SUITE $ROOT_PACKAGES"
  if [ -f "$ROOT/$ROOT_MARK" ] && [ "$(cat "$ROOT/$ROOT_MARK")" = "$want" ]; then return 0; fi
  need_root
  mkdir -p "$ROOTS"
  exec {lock}>"$ROOTS/.build.lock"
  flock "$lock" # a parallel `up` builds it meanwhile: then it is there
  if [ -f "$ROOT/$ROOT_MARK" ] && [ "$(cat "$ROOT/$ROOT_MARK")" = "$want" ]; then return 0; fi
  if ! command -v debootstrap >/dev/null; then
    log "installing debootstrap"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
  fi
  log "building the Slurm $SLURM_RELEASE root: debootstrap $SUITE into $ROOT (about 30 s)"
  tmp=$ROOT.new
  mkdir -p "$ROOTS"
  # What an interrupted build left: never rm -r through a bind mount (same filesystem, so
  # --one-file-system would not stop it).
  umount_under "$tmp"
  rm -rf --one-file-system "$tmp"
  mkdir -p "$ROOTS/cache"
  if ! debootstrap --variant=minbase --cache-dir="$ROOTS/cache" --include="${ROOT_PACKAGES// /,}" "$SUITE" "$tmp" "$MIRROR" \
    >"$ROOTS/$SUITE.log" 2>&1; then
    tail -n 20 "$ROOTS/$SUITE.log" >&2
    exit 1
  fi
  rm -f "$tmp/var/cache/apt/archives/"*.deb
  echo "$want" >"$tmp/$ROOT_MARK"
  if [ -d "$ROOT" ]; then
    umount_under "$ROOT"
    rm -rf --one-file-system "$ROOT"
  fi
  mv "$tmp" "$ROOT"
  log "root ready: $(chroot "$ROOT" slurmctld -V)"
}

root_bind() { # PATH: bind-mounted at the same path inside the root (once)
  local src=$1 dst=$ROOT$1
  [ -e "$src" ] || return 0
  if mountpoint -q "$dst" 2>/dev/null; then
    [ "$(stat -c %d:%i "$src")" = "$(stat -c %d:%i "$dst")" ] && return 0
    # A bind of a directory since deleted and made again at the same path (a CI checkout
    # cloned afresh): the root would see the old, empty one. Bind the new one.
    umount -l "$dst"
  fi
  if [ -d "$src" ]; then mkdir -p "$dst"; else mkdir -p "$(dirname "$dst")" && touch "$dst"; fi
  mount --bind "$src" "$dst"
}

root_mounts() { # what the root's daemons and jobs see of the host; the mounts stay until a rebuild
  local d repo lock
  repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
  # Instances of the root come up in parallel (one test worker each): one at a time here.
  exec {lock}>"$ROOTS/.mounts.lock"
  flock "$lock"
  if ! mountpoint -q "$ROOT"; then
    # The root a mount of its own, under everything else: runc (Slurm's OCI support) makes the
    # container's "/" a slave mount, which fails (EINVAL) where "/" is no mount point.
    umount_under "$ROOT"
    mount --bind "$ROOT" "$ROOT"
  fi
  mountpoint -q "$ROOT/proc" || mount -t proc proc "$ROOT/proc"
  for d in sys dev; do
    if ! mountpoint -q "$ROOT/$d"; then
      mount --rbind "/$d" "$ROOT/$d"
      mount --make-rslave "$ROOT/$d"
    fi
  done
  # shellcheck disable=SC2086
  for d in /tmp /root /home "$repo" ${TESTBED_BINDS:-}; do root_bind "$d"; done
  mkdir -p "$STATE" "$LOGS"
  root_bind "$STATE"
  root_bind "$LOGS"
  if [ "$OCI" = 1 ]; then # the container tests' image (`image`): the OCI bundle's rootfs
    root_bind "$ROOTS/image-trixie"
    root_bind "$ROOTS/oci-bundle"
  fi
  cp /etc/hosts "$ROOT/etc/hosts" # the node names (write_hosts)
  exec {lock}>&-
}

make_wrappers() { # $STATE/bin/CMD: the root's CMD, run in the caller's working directory
  local cmd path
  mkdir -p "$WRAPPERS"
  for cmd in $SLURM_COMMANDS; do
    path=$(chroot "$ROOT" /usr/bin/env PATH=/usr/sbin:/usr/bin:/sbin:/bin sh -c "command -v $cmd" 2>/dev/null) || continue
    {
      echo '#!/bin/sh'
      echo "# $cmd of Slurm $SLURM_RELEASE (testbed instance $NAME), written by scripts/testbed.sh"
      echo "[ -e /$ROOT_MARK ] && exec $path \"\$@\" # inside the root already (a job's process)"
      echo 'conf=${SLURM_CONF:-/etc/slurm/slurm.conf}'
      echo "[ -e \"$ROOT\$conf\" ] || { echo \"$cmd: \$conf is not in the Slurm $SLURM_RELEASE root (instance down?)\" >&2; exit 1; }"
      echo 'dir=$(pwd -P 2>/dev/null) || dir=/'
      echo "[ -d \"$ROOT\$dir\" ] || dir=/"
      echo "exec chroot $ROOT /usr/bin/env -C \"\$dir\" $path \"\$@\""
    } >"$WRAPPERS/$cmd.tmp"
    chmod 0755 "$WRAPPERS/$cmd.tmp"
    mv -f "$WRAPPERS/$cmd.tmp" "$WRAPPERS/$cmd"
  done
  case ":$PATH:" in *":$WRAPPERS:"*) ;; *) export PATH="$WRAPPERS:$PATH" ;; esac
}


# --- A container image for the container tests (`image`) ------------------------------------------
# A Debian trixie root with no Slurm in it (`debootstrap --variant=minbase`, the debs from the Slurm
# root's cache: no second download) is both the podman image localhost/hpcelastic-testbed:trixie
# (`podman import`, no registry) and the rootfs of the OCI bundle $ROOTS/oci-bundle (config.json from
# `runc spec`) that Slurm's OCI support runs. It holds the libraries the host's Python needs; the
# tests mount the host's Python and the .venv into it. Rootful podman runs here with runc (crun
# refuses this machine's cgroup layout), cgroupfs and the default ulimits capped (containers.conf).
IMAGE_PACKAGES="libssl3t64 libffi8 libsqlite3-0 libbz2-1.0 liblzma5 libuuid1 libreadline8t64 libncursesw6 libstdc++6 procps"
IMAGE_NAME=localhost/hpcelastic-testbed:trixie
CONTAINERS_CONF=/etc/containers/containers.conf

podman_config() { # rootful podman with runc on this machine; kept if an admin wrote one
  if [ -s "$CONTAINERS_CONF" ] && ! grep -q 'hpcelastic scripts/testbed.sh' "$CONTAINERS_CONF"; then return 0; fi
  mkdir -p "$(dirname "$CONTAINERS_CONF")"
  cat >"$CONTAINERS_CONF" <<'EOF'
# Written by hpcelastic scripts/testbed.sh: rootful podman for the container tests.
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
}

build_image() { # the image root, the podman image and the OCI bundle, once
  local root=$ROOTS/image-trixie want bundle=$ROOTS/oci-bundle lock
  need_root
  mkdir -p "$ROOTS"
  exec {lock}>"$ROOTS/.image.lock"
  flock "$lock"
  command -v podman >/dev/null && command -v runc >/dev/null || {
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends podman runc >/dev/null
  }
  podman_config
  want="trixie $IMAGE_PACKAGES"
  if ! [ -f "$root/$ROOT_MARK" ] || [ "$(cat "$root/$ROOT_MARK")" != "$want" ]; then
    umount_under "$root"
    rm -rf --one-file-system "$root" "$root.new"
    mkdir -p "$ROOTS/cache"
    log "building the container image root: debootstrap trixie into $root"
    debootstrap --variant=minbase --cache-dir="$ROOTS/cache" --include="${IMAGE_PACKAGES// /,}" trixie "$root.new" \
      "$MIRROR" >"$ROOTS/image-trixie.log" 2>&1 || { tail -n 20 "$ROOTS/image-trixie.log" >&2; exit 1; }
    rm -f "$root.new/var/cache/apt/archives/"*.deb
    echo "$want" >"$root.new/$ROOT_MARK"
    mv "$root.new" "$root"
    podman rmi -f "$IMAGE_NAME" >/dev/null 2>&1 || true
  fi
  if ! podman image exists "$IMAGE_NAME"; then
    tar -C "$root" -c . | podman import --quiet - "$IMAGE_NAME" >/dev/null
  fi
  if [ ! -s "$bundle/config.json" ]; then
    mkdir -p "$bundle"
    ln -sfn "$root" "$bundle/rootfs"
    (cd "$bundle" && runc spec && sed -i 's/"terminal": true/"terminal": false/' config.json)
  fi
  log "image $IMAGE_NAME and OCI bundle $bundle ready"
}

node_names() {
  local i
  for i in $(seq 1 "$NODES"); do echo "$PREFIX$i"; done
}

unresolvable() { # NODE: is its name kept out of /etc/hosts?
  case "$UNRESOLVABLE" in
    "" | 0 | no | false) return 1 ;;
    1 | all | yes | true) return 0 ;;
  esac
  [[ " ${UNRESOLVABLE//,/ } " == *" $1 "* ]]
}

write_hosts() {
  local i node kept
  for i in $(seq 1 "$NODES"); do
    node=$PREFIX$i
    if unresolvable "$node"; then
      grep -qE "[[:space:]]$node\$" /etc/hosts || continue
      kept=$(grep -vE "[[:space:]]$node\$" /etc/hosts || true)
      printf '%s\n' "$kept" >/etc/hosts
    elif ! grep -qE "^${NET//./\\.}\.$i[[:space:]]+$node\$" /etc/hosts; then
      # /etc/hosts may be a bind mount: rewrite it in place rather than replacing the file.
      kept=$(grep -vE "[[:space:]]$node\$" /etc/hosts || true)
      printf '%s\n%s.%s %s\n' "$kept" "$NET" "$i" "$node" >/etc/hosts
    fi
  done
}

make_fake_gpus() {
  local node g
  for node in $(node_names); do
    mkdir -p "$DEVS/$node"
    for g in $(seq 0 $((GPUS - 1))); do
      [ -c "$DEVS/$node/nvidia$g" ] || mknod "$DEVS/$node/nvidia$g" c 195 "$g"
    done
  done
}

write_config() {
  local host i
  host=$(hostname -s)
  mkdir -p "$CONF_DIR" "$STATE/ctld" "$LOGS" "$RUN"
  {
    echo "# Written by hpcelastic scripts/testbed.sh (instance $NAME): a test cluster on one host."
    echo "ClusterName=$CLUSTER"
    echo "SlurmctldHost=$host($CTLD_ADDR)"
    echo "SlurmctldPort=$CTLD_PORT"
    echo "SlurmUser=root"
    echo "AuthType=auth/munge"
    echo "CredType=cred/munge"
    # Requeued jobs are eligible again only after cred_expire: keep it short for tests.
    echo "AuthInfo=cred_expire=$CRED_EXPIRE"
    echo "StateSaveLocation=$STATE/ctld"
    echo "SlurmdSpoolDir=$STATE/spool/%n"
    # Pid files of this instance only: start/stop/status go by them.
    echo "SlurmctldPidFile=$RUN/slurmctld.pid"
    echo "SlurmdPidFile=$RUN/slurmd-%n.pid"
    echo "SlurmctldLogFile=$LOGS/slurmctld.log"
    echo "SlurmdLogFile=$LOGS/slurmd-%n.log"
    echo "SlurmctldDebug=info"
    echo "SlurmdDebug=info"
    # No cgroups in containers: track processes by parentage.
    echo "ProctrackType=proctrack/linuxproc"
    if [ -z "$ROOT" ]; then
      echo "TaskPlugin=$TASK_PLUGIN"
      echo "JobAcctGatherType=jobacct_gather/none"
      echo "AccountingStorageType=accounting_storage/none"
    elif [ "$TASK_PLUGIN" != task/none ]; then
      # 23.02 and later have no */none plugins: leaving the key out is "none".
      echo "TaskPlugin=$TASK_PLUGIN"
    fi
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
    echo "SlurmdTimeout=$SLURMD_TIMEOUT"
    echo "InactiveLimit=0"
    echo "Waittime=0"
    if [ "$PREEMPT" = 1 ]; then
      echo "PreemptType=preempt/partition_prio"
      echo "PreemptMode=REQUEUE"
      if [ "$PREEMPT_GRACE" != 0 ]; then
        # The same setting under its two names: 22.05's, and PreemptParameters= from 23.02.
        if [ -z "$ROOT" ]; then echo "SlurmctldParameters=preempt_send_user_signal"; else echo "PreemptParameters=send_user_signal"; fi
      fi
    fi
    for i in $(seq 1 "$NODES"); do
      echo "NodeName=$PREFIX$i NodeHostname=$host NodeAddr=$NET.$i Port=$((NODE_PORT0 + i)) CPUs=$CPUS RealMemory=4000 Gres=gpu:$GPUS State=UNKNOWN"
    done
    if [ "$PREEMPT" = 1 ]; then
      echo "PartitionName=debug Nodes=$PREFIX[1-$NODES] Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=$PREEMPT_GRACE"
      echo "PartitionName=urgent Nodes=$PREFIX[1-$NODES] MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF"
    else
      echo "PartitionName=debug Nodes=$PREFIX[1-$NODES] Default=YES MaxTime=INFINITE State=UP"
    fi
  } >"$CONF"
  {
    for i in $(seq 1 "$NODES"); do
      echo "NodeName=$PREFIX$i Name=gpu File=$DEVS/$PREFIX$i/nvidia[0-$((GPUS - 1))]"
    done
  } >"$CONF_DIR/gres.conf"
  # No cgroup.conf: Slurm 22.05 then uses its defaults, which work in containers
  # (a "CgroupPlugin=disabled" line is 23.x syntax and makes 22.05 slurmd fail). 24.11's slurmd
  # insists on a cgroup plugin unless told CgroupPlugin=disabled.
  # task/cgroup confines a step to its CPUs only with ConstrainCores=yes (the default is no).
  if [[ "$TASK_PLUGIN" == *task/cgroup* ]]; then
    echo "ConstrainCores=yes" >"$CONF_DIR/cgroup.conf"
  elif [ -n "$ROOT" ]; then
    echo "CgroupPlugin=disabled" >"$CONF_DIR/cgroup.conf"
  else
    rm -f "$CONF_DIR/cgroup.conf"
  fi
  # Slurm's OCI support (srun --container=BUNDLE) with runc, as the site admin docs have it;
  # `exec`: a step's signal reaches runc itself, which forwards it into the container (without it
  # the signal kills the shell around runc and leaves the container running).
  if [ "$OCI" = 1 ]; then
    local runc="runc --root=$RUN/runc"
    {
      echo "# Written by hpcelastic scripts/testbed.sh: Slurm's OCI support with runc (TESTBED_OCI=1)."
      echo "RunTimeQuery=\"$runc state %n.%u.%j.%s.%t\""
      echo "RunTimeKill=\"$runc kill -a %n.%u.%j.%s.%t\""
      echo "RunTimeDelete=\"$runc delete --force %n.%u.%j.%s.%t\""
      echo "RunTimeRun=\"exec $runc run %n.%u.%j.%s.%t -b %b\""
    } >"$CONF_DIR/oci.conf"
  else
    rm -f "$CONF_DIR/oci.conf"
  fi
}

# munged with its directories and key (made on first use), as Debian's service starts it.
MUNGED='
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  chmod 0755 /run/munge
  if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
  fi
  runuser -u munge -- /usr/sbin/munged'

start_munge() { # [ROOT]: the host's munged, or a Slurm root's own (its /run, its key)
  # One munged serves every instance of a Slurm (same key); it is never stopped by `down`.
  local root=${1:-} in=()
  if [ -n "$root" ]; then in=(chroot "$root"); fi
  if [ -S "$root/run/munge/munge.socket.2" ] && "${in[@]}" munge -n </dev/null >/dev/null 2>&1; then
    return 0
  fi
  "${in[@]}" sh -c "$MUNGED"
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
  ready=$(sinfo -h -N -o '%N %T' 2>/dev/null | sort -u | grep -cE ' (idle|mixed|allocated)$' || true)
  [ "$ready" -ge "$NODES" ]
}

# --- daemons by pid file -------------------------------------------------------------------------

conf_value() { # KEY: its value in the config on disk (the one the running daemons were started with)
  [ -r "$CONF" ] || return 0
  sed -n "s/^$1=//p" "$CONF" | tail -n 1
}

ctld_pidfile() { local f; f=$(conf_value SlurmctldPidFile); echo "${f:-$RUN/slurmctld.pid}"; }

slurmd_pidfile() { # NODE
  local f
  f=$(conf_value SlurmdPidFile)
  f=${f:-$RUN/slurmd-%n.pid}
  echo "${f//%n/$1}"
}

cmdline() { tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null || true; }

# Is PID a live DAEMON (slurmctld, or slurmd with NODE) of this instance? Daemons are started with
# `-f $CONF`; ones started without -f (older testbed.sh) belong to the instance whose config is
# /etc/slurm/slurm.conf.
is_ours() { # PID DAEMON [NODE]
  local pid=$1 daemon=$2 node=${3:-} cmd
  [ -n "$pid" ] && [ -d "/proc/$pid" ] || return 1
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$daemon" ] || return 1
  grep -q '^State:[[:space:]]*Z' "/proc/$pid/status" 2>/dev/null && return 1
  cmd=" $(cmdline "$pid")"
  if [[ "$cmd" == *" -f "* ]]; then
    [[ "$cmd" == *" -f $CONF "* ]] || return 1
  else
    [ "$CONF" = /etc/slurm/slurm.conf ] || return 1
  fi
  if [ -n "$node" ]; then [[ "$cmd" == *" -N $node "* ]] || return 1; fi
  return 0
}

pid_from() { # PIDFILE
  local p
  p=$(cat "$1" 2>/dev/null || true)
  p=${p//[!0-9]/}
  echo "$p"
}

ctld_pid() { local p; p=$(pid_from "$(ctld_pidfile)"); if is_ours "$p" slurmctld; then echo "$p"; fi; }

slurmd_pid() { # NODE
  local p
  p=$(pid_from "$(slurmd_pidfile "$1")")
  if is_ours "$p" slurmd "$1"; then echo "$p"; fi
}

valid_node() { # NODE
  local n
  for n in $(node_names); do [ "$n" = "$1" ] && return 0; done
  log "no node $1 in instance $NAME ($(node_names | xargs))"
  exit 2
}

# Every process of NODE's jobs. slurmstepd daemons are reparented to init and carry no node name in
# their environment, but each one listens on a socket in its node's SlurmdSpoolDir and writes its
# node's SlurmdLogFile: those open files tie it to the node. Job tasks have SLURMD_NODENAME=NODE and
# SLURM_CLUSTER_NAME of this cluster in their environment (that also catches a task that left its
# tree). All descendants of those are added.
node_job_pids() { # NODE
  local node=$1 spool logf p f inodes files self=$$
  spool=$(conf_value SlurmdSpoolDir)
  spool=${spool:-$STATE/spool/%n}
  spool=${spool//%n/$node}
  logf=$(conf_value SlurmdLogFile)
  logf=${logf//%n/$node}
  inodes=" $(awk -v d="$spool/" 'index($8, d) == 1 {printf "%s ", $7}' /proc/net/unix 2>/dev/null) "
  local -A seed=()
  for p in $(pgrep -x slurmstepd || true); do
    for f in "/proc/$p/fd/"*; do
      f=$(readlink "$f" 2>/dev/null) || continue
      # (a chrooted slurmstepd's log file reads, from here, as the root's path + the path)
      if [ -n "$logf" ] && { [ "$f" = "$logf" ] || [ "$f" = "$ROOT$logf" ]; }; then seed[$p]=1; break; fi
      if [[ "$f" == socket:\[*\] ]] && [[ "$inodes" == *" ${f//[!0-9]/} "* ]]; then seed[$p]=1; break; fi
    done
  done
  for f in $(grep -lzx "SLURMD_NODENAME=$node" /proc/[0-9]*/environ 2>/dev/null || true); do
    grep -qzx "SLURM_CLUSTER_NAME=$CLUSTER" "$f" 2>/dev/null || continue
    p=${f#/proc/}
    seed[${p%%/*}]=1
  done
  if [ "$NETNS" = 1 ] && [ -e "/run/netns/$(netns_of "$node")" ]; then
    # Every process in the node's network namespace is the node's.
    for p in $(ip netns pids "$(netns_of "$node")" 2>/dev/null || true); do seed[$p]=1; done
    for p in $(slurmd_pid "$node") $(delay_pid "$node"); do unset "seed[$p]"; done
  fi
  unset "seed[$self]"
  [ "${#seed[@]}" -gt 0 ] || return 0
  # Descendants, from one snapshot of the process table.
  local -A all=() kids=()
  local pid ppid changed=1
  while read -r pid ppid; do kids[$ppid]+="$pid "; done < <(ps -e -o pid=,ppid=)
  for p in "${!seed[@]}"; do all[$p]=1; done
  while [ "$changed" = 1 ]; do
    changed=0
    for p in "${!all[@]}"; do
      for pid in ${kids[$p]:-}; do
        [ -n "${all[$pid]:-}" ] && continue
        [ "$pid" = "$self" ] && continue
        all[$pid]=1
        changed=1
      done
    done
  done
  printf '%s\n' "${!all[@]}" | sort -n
}

node_pids() { # NODE: its slurmd and every process of its jobs
  local d
  d=$(slurmd_pid "$1")
  [ -n "$d" ] && echo "$d"
  node_job_pids "$1"
}

has_slurmd() { [ -n "$(slurmd_pid "$1")" ]; }

start_slurmd() { # NODE
  local node=$1
  [ -n "$(slurmd_pid "$node")" ] && return 0
  mkdir -p "$STATE/spool/$node" "$RUN"
  rm -f "$(slurmd_pidfile "$node")"
  if [ "$NETNS" = 1 ]; then
    in_node "$node" slurmd -f "$CONF" -N "$node"
  else
    slurmd -f "$CONF" -N "$node"
  fi
  wait_for "slurmd $node to write its pid file" 40 has_slurmd "$node" \
    || { tail -n 20 "$LOGS/slurmd-$node.log" >&2 || true; return 1; }
}

stop_pids() { # NAME PID...: SIGTERM, then SIGKILL after ~10 s
  local what=$1 n=0 p alive
  shift
  [ "$#" -gt 0 ] || return 0
  kill -TERM "$@" 2>/dev/null || true
  while :; do
    alive=()
    for p in "$@"; do [ -d "/proc/$p" ] && ! grep -q '^State:[[:space:]]*Z' "/proc/$p/status" 2>/dev/null && alive+=("$p"); done
    [ "${#alive[@]}" -eq 0 ] && return 0
    n=$((n + 1))
    if [ "$n" -eq 40 ]; then
      log "$what did not stop on SIGTERM: SIGKILL ${alive[*]}"
      kill -KILL "${alive[@]}" 2>/dev/null || true
    fi
    [ "$n" -gt 80 ] && { log "$what still alive: ${alive[*]}"; return 1; }
    sleep 0.25
  done
}

# --- network namespaces (TESTBED_NETNS=1) --------------------------------------------------------
# Node i of instance I lives in netns hpce-NAME-NODE as 198.18.I.i/24 on its eth0, the peer of veth
# hpceIn<i> on bridge hpcebrI (198.18.I.254, slurmctld's address) in the root namespace. No default
# route: a node reaches its instance's subnet and nothing else. Faults are nftables rules on the
# bridge side of the node's veth (table netdev hpce_NAME_NODE: its egress goes to the node, its ingress
# comes from it), so they hit every packet of the node and nothing of the others, silently, as a
# fabric does: the node's interfaces stay up, its sockets see no error, and files (the shared
# filesystem, munge's socket) are not network.

netns_of() { echo "hpce-$NAME-$1"; }
nft_table_of() { echo "hpce_${NAME}_$1"; }
node_index() { echo "${1#"$PREFIX"}"; }
veth_of() { echo "hpce${NET_INDEX}n$(node_index "$1")"; }
in_node() { local ns; ns=$(netns_of "$1"); shift; nsenter --net="/run/netns/$ns" "$@"; }

need_netns() { # COMMAND
  if [ "$NETNS" != 1 ]; then
    log "$1 needs an instance with a network per node (up a stopped instance with TESTBED_NETNS=1)"
    exit 2
  fi
}

net_up() {
  local node i ns veth
  ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
  ip addr replace "$CTLD_ADDR/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  for node in $(node_names); do
    i=$(node_index "$node")
    ns=$(netns_of "$node")
    veth=$(veth_of "$node")
    [ -e "/run/netns/$ns" ] || ip netns add "$ns"
    if ! ip link show "$veth" >/dev/null 2>&1; then
      ip link add "$veth" type veth peer name "${veth}p"
      ip link set "${veth}p" netns "$ns"
      ip -n "$ns" link set "${veth}p" name eth0
    fi
    ip -n "$ns" addr replace "$NET.$i/24" dev eth0
    ip -n "$ns" link set lo up
    ip -n "$ns" link set eth0 up
    ip link set "$veth" master "$BRIDGE" up
    nft -f - <<EOF
table netdev $(nft_table_of "$node")
delete table netdev $(nft_table_of "$node")
table netdev $(nft_table_of "$node") {
  chain cut_in {}
  chain cut_out {}
  chain part_in {}
  chain part_out {}
  chain loss_in {}
  chain loss_out {}
  chain to_node { type filter hook egress device "$veth" priority 0; policy accept; jump cut_in; jump part_in; jump loss_in; }
  chain from_node { type filter hook ingress device "$veth" priority 0; policy accept; jump cut_out; jump part_out; jump loss_out; }
}
EOF
  done
}

net_down() { # the namespaces (and their processes), veths, bridge and fault timers of this instance
  local ns p node
  for node in $(node_names); do stop_timer "$node"; done
  for p in $(nft list tables netdev 2>/dev/null | awk -v pre="hpce_${NAME}_" 'index($3, pre) == 1 {print $3}'); do
    nft delete table netdev "$p" 2>/dev/null || true
  done
  for ns in $(ip netns list 2>/dev/null | awk -v pre="hpce-$NAME-" 'index($1, pre) == 1 {print $1}'); do
    p=$(ip netns pids "$ns" 2>/dev/null | xargs)
    # shellcheck disable=SC2086
    if [ -n "$p" ]; then kill -KILL $p 2>/dev/null || true; fi
    ip netns del "$ns" 2>/dev/null || true
  done
  for p in $(ip -o link show 2>/dev/null | awk -F': ' -v pre="hpce${NET_INDEX}n" 'index($2, pre) == 1 {sub(/@.*/, "", $2); print $2}'); do
    ip link del "$p" 2>/dev/null || true
  done
  ip link del "$BRIDGE" 2>/dev/null || true
}

node_addr() { # NODE or slurmctld
  if [ "$1" = slurmctld ]; then echo "$CTLD_ADDR"; else echo "$NET.$(node_index "$1")"; fi
}

nft_rules() { # NODE CHAIN RULE: RULE in NODE's CHAIN_in (to it: DIR=saddr) and CHAIN_out (from it: DIR=daddr)
  nft -f - <<EOF
add rule netdev $(nft_table_of "$1") ${2}_in ${3//DIR/saddr}
add rule netdev $(nft_table_of "$1") ${2}_out ${3//DIR/daddr}
EOF
}

nft_flush() { # NODE CHAIN
  nft -f - <<EOF
flush chain netdev $(nft_table_of "$1") ${2}_in
flush chain netdev $(nft_table_of "$1") ${2}_out
EOF
}

link_cut() { nft_flush "$1" cut; nft_rules "$1" cut drop; }
link_restore() { nft_flush "$1" cut; }

timer_pidfile() { echo "$FAULTS/$1.timer"; }

stop_timer() { # NODE: end NODE's background fault process (timed cut or flap), if any
  local f p
  f=$(timer_pidfile "$1")
  p=$(pid_from "$f")
  if [ -n "$p" ] && [[ "$(cmdline "$p") " == *" _timer $1 "* ]]; then
    kill -TERM -- "-$p" 2>/dev/null || kill -TERM "$p" 2>/dev/null || true
  fi
  rm -f "$f"
}

start_timer() { # NODE ARGS...: `testbed.sh _timer NODE ARGS...`, detached (own session, no stdio)
  local node=$1
  shift
  stop_timer "$node"
  mkdir -p "$FAULTS"
  setsid bash "${BASH_SOURCE[0]}" _timer "$node" "$@" </dev/null >/dev/null 2>&1 &
  echo $! >"$(timer_pidfile "$node")"
}

timer() { # NODE cut SECONDS | NODE flap DOWN_S UP_S COUNT (the link is cut when it starts)
  local node=$1 kind=$2 n
  case "$kind" in
    cut)
      sleep "$3"
      link_restore "$node"
      ;;
    flap)
      for n in $(seq 1 "$5"); do
        if [ "$n" -gt 1 ]; then link_cut "$node"; fi
        sleep "$3"
        link_restore "$node"
        if [ "$n" -lt "$5" ]; then sleep "$4"; fi
      done
      ;;
  esac
  rm -f "$(timer_pidfile "$node")"
}

seconds() { # WHAT VALUE: exit 2 unless VALUE is a non-negative number
  if ! [[ "$2" =~ ^[0-9]+([.][0-9]+)?$ ]]; then
    log "$1 must be a number of seconds, not '$2'"
    exit 2
  fi
}

cut_link() { # NODE [SECONDS]
  local node=$1 secs=${2:-0}
  seconds SECONDS "$secs"
  stop_timer "$node"
  link_cut "$node"
  if [[ "$secs" =~ ^0*([.]0*)?$ ]]; then
    echo "cut-link $node: every packet to and from $(node_addr "$node") dropped until heal"
  else
    start_timer "$node" cut "$secs"
    echo "cut-link $node: every packet to and from $(node_addr "$node") dropped for $secs s"
  fi
}

flap() { # NODE DOWN_S UP_S COUNT
  local node=$1
  seconds DOWN_S "${2:-}"
  seconds UP_S "${3:-}"
  if ! [[ "${4:-}" =~ ^[1-9][0-9]*$ ]]; then
    log "flap: COUNT must be a positive integer, not '${4:-}'"
    exit 2
  fi
  stop_timer "$node"
  link_cut "$node"
  start_timer "$node" flap "$2" "$3" "$4"
  echo "flap $node: link cut for $2 s, restored for $3 s, $4 times"
}

partition() { # NODE PEER...
  local node=$1 peer
  shift
  [ "$#" -gt 0 ] || { log "usage: partition NODE PEER..."; exit 2; }
  for peer in "$@"; do
    [ "$peer" = slurmctld ] || valid_node "$peer"
    if [ "$peer" = "$node" ]; then log "partition: $node cannot be cut off from itself"; exit 2; fi
  done
  for peer in "$@"; do nft_rules "$node" part "ip DIR $(node_addr "$peer") drop"; done
  echo "partition $node: no packets between it and $*"
}

# netem's delay where the kernel has no sch_netem (this CI machine): iptables NFQUEUE in the node's
# namespace hands each packet of eth0, both ways, to this process there, which lets it go DELAY +-
# JITTER later. It is the fabric's, not the node's: kill-node and pids leave it out.
IFS= read -r -d '' DELAY_QUEUE_PY <<'PY' || true
import heapq, random, select, socket, struct, sys, time

# argv: MARKER DELAY_S JITTER_S. Packets that iptables NFQUEUE puts in queue 0 of this network
# namespace are accepted DELAY_S +- uniform(JITTER_S) later. Raw nfnetlink_queue, stdlib only.
delay, jitter = float(sys.argv[2]), float(sys.argv[3])
NFQ = 3 << 8  # NFNL_SUBSYS_QUEUE
PACKET, VERDICT, CONFIG = NFQ | 0, NFQ | 1, NFQ | 2
sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 12)  # NETLINK_NETFILTER
sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
sock.bind((0, 0))


def attr(kind, payload):
    return struct.pack("=HH", 4 + len(payload), kind) + payload + b"\0" * (-len(payload) % 4)


def send(kind, attrs, flags=1):
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(0)) + b"".join(attrs)
    sock.send(struct.pack("=IHHII", 16 + len(body), kind, flags, 0, 0) + body)


send(CONFIG, [attr(1, struct.pack("!BBH", 1, 0, socket.AF_INET))])  # NFQNL_CFG_CMD_BIND
send(CONFIG, [attr(2, struct.pack("!IB", 0, 1))])  # NFQNL_COPY_META
send(CONFIG, [attr(3, struct.pack("!I", 65536))])  # queue length
held = []
while True:
    wait = max(0.0, held[0][0] - time.monotonic()) if held else None
    if select.select([sock], [], [], wait)[0]:
        data = sock.recv(1 << 16)
        while len(data) >= 16:
            size, kind = struct.unpack_from("=IH", data)
            if kind == PACKET:
                at = 20
                while at < size:
                    alen, akind = struct.unpack_from("=HH", data, at)
                    if akind & 0x7FFF == 1:  # NFQA_PACKET_HDR
                        pid = struct.unpack_from("!I", data, at + 4)[0]
                        due = time.monotonic() + max(0.0, delay + random.uniform(-jitter, jitter))
                        heapq.heappush(held, (due, pid))
                    at += (alen + 3) & ~3
            data = data[(size + 3) & ~3 :]
    now = time.monotonic()
    while held and held[0][0] <= now:
        _, pid = heapq.heappop(held)
        send(VERDICT, [attr(2, struct.pack("!II", 1, pid))])  # NF_ACCEPT
PY
DELAY_MARKER=hpce-delay-queue

delay_pidfile() { echo "$FAULTS/$1.delay"; }

delay_pid() { # NODE: its delay process, if running
  local p
  p=$(pid_from "$(delay_pidfile "$1")")
  if [ -n "$p" ] && [[ "$(cmdline "$p")" == *" $DELAY_MARKER "* ]]; then echo "$p"; fi
}

delay_start() { # NODE DELAY_S JITTER_S
  local node=$1 py
  py=$(command -v python3) || { log "netem delay needs python3"; exit 2; }
  mkdir -p "$FAULTS"
  setsid nsenter --net="/run/netns/$(netns_of "$node")" "$py" -c "$DELAY_QUEUE_PY" "$DELAY_MARKER" "$2" "$3" \
    </dev/null >>"$LOGS/delay-$node.log" 2>&1 &
  echo $! >"$(delay_pidfile "$node")"
  # Queue only once it listens: until then --queue-bypass would let packets through undelayed.
  wait_for "the delay queue of $node" 40 delay_listening "$node" || { delay_stop "$node"; exit 1; }
  in_node "$node" iptables-legacy -t mangle -A PREROUTING -i eth0 -j NFQUEUE --queue-num 0 --queue-bypass
  in_node "$node" iptables-legacy -t mangle -A POSTROUTING -o eth0 -j NFQUEUE --queue-num 0 --queue-bypass
}

delay_listening() { # NODE
  in_node "$1" awk '$1 == 0 {found = 1} END {exit !found}' /proc/net/netfilter/nfnetlink_queue
}

delay_stop() { # NODE
  local p
  if command -v iptables-legacy >/dev/null; then in_node "$1" iptables-legacy -t mangle -F 2>/dev/null || true; fi
  p=$(delay_pid "$1")
  if [ -n "$p" ]; then kill -TERM "$p" 2>/dev/null || true; fi
  rm -f "$(delay_pidfile "$1")"
}

netem_off() { # NODE
  tc qdisc del dev "$(veth_of "$1")" root 2>/dev/null || true
  in_node "$1" tc qdisc del dev eth0 root 2>/dev/null || true
  nft_flush "$1" loss
  delay_stop "$1"
}

seconds_of() { # TIME (tc's units: 50ms, 1.5s, 800us): seconds, or nothing if TIME is not one
  [[ "$1" =~ ^([0-9]+([.][0-9]+)?)(s|sec|ms|msec|us|usec)$ ]] || return 0
  awk -v n="${BASH_REMATCH[1]}" -v u="${BASH_REMATCH[3]}" \
    'BEGIN {f = (u ~ /^us/) ? 1e-6 : (u ~ /^ms/) ? 1e-3 : 1; printf "%.6f", n * f}'
}

netem() { # NODE ARGS... | NODE off
  local node=$1 loss="" delay="" jitter=0 basis
  shift
  [ "$#" -gt 0 ] || { log "usage: netem NODE ARGS... | netem NODE off"; exit 2; }
  netem_off "$node"
  if [ "$*" = off ]; then
    echo "netem $node: off"
    return 0
  fi
  # Both directions: the bridge side's egress reaches the node, the node's eth0 egress leaves it.
  if tc qdisc replace dev "$(veth_of "$node")" root netem "$@" 2>/dev/null; then
    in_node "$node" tc qdisc replace dev eth0 root netem "$@"
    echo "netem $node: $* (tc netem, both directions)"
    return 0
  fi
  # No sch_netem in this kernel: `loss P%` becomes nftables rules, `delay TIME [JITTER]` a delay queue.
  local args="$*"
  while [ "$#" -gt 0 ]; do
    case "$1" in
      loss)
        [[ "${2:-}" =~ ^[0-9]+([.][0-9]{1,2})?%$ ]] || break
        loss=${2%\%}
        shift 2
        ;;
      delay)
        delay=$(seconds_of "${2:-}")
        [ -n "$delay" ] || break
        shift 2
        if [ "$#" -gt 0 ] && [ -n "$(seconds_of "$1")" ]; then jitter=$(seconds_of "$1"); shift; fi
        ;;
      *) break ;;
    esac
  done
  if [ "$#" -gt 0 ]; then
    log "netem $node: this kernel has no sch_netem; emulated: 'loss P%' and 'delay TIME [JITTER]' (units s/ms/us), not '$args'"
    exit 2
  fi
  if [ -n "$loss" ]; then
    basis=$(awk -v p="$loss" 'BEGIN {printf "%d", p * 100 + 0.5}')
    if [ "$basis" -gt 10000 ]; then log "netem: loss above 100%"; exit 2; fi
    nft_rules "$node" loss "numgen random mod 10000 < $basis drop"
  fi
  if [ -n "$delay" ]; then delay_start "$node" "$delay" "$jitter"; fi
  echo "netem $node: $args in each direction (nftables loss, NFQUEUE delay: this kernel has no sch_netem)"
}

heal() { # NODE
  local node=$1
  stop_timer "$node"
  nft_flush "$node" cut
  nft_flush "$node" part
  netem_off "$node"
  echo "heal $node: link up, no partition, no netem"
}

fault_checks() { # COMMAND NODE: a netns instance, a node of it, its namespace there
  need_netns "$1"
  valid_node "$2"
  need_root
  if [ ! -e "/run/netns/$(netns_of "$2")" ]; then
    log "$1: no namespace for $2 (instance down?)"
    exit 2
  fi
}

# --- commands ------------------------------------------------------------------------------------

up() {
  need_root
  install_packages
  local node running=0
  [ -n "$(ctld_pid)" ] && running=1
  if [ "$running" = 1 ]; then
    # Never rewrite the config under running daemons: they would disagree with their clients.
    log "slurmctld $(ctld_pid) already running: config $CONF kept (down + up applies new settings)"
  else
    net_down
    NETNS=${TESTBED_NETNS:-0}
    NET_INDEX=$INDEX
    set_net
    SLURM_RELEASE=${TESTBED_SLURM:-host}
    set_release
    mkdir -p "$STATE"
    echo "$NETNS $NET_INDEX" >"$NETNS_FILE"
    echo "$SLURM_RELEASE" >"$SLURM_FILE"
    if [ -z "$ROOT" ]; then rm -rf "$WRAPPERS"; fi # the host's commands: no wrappers left on PATH
    install_packages
    write_config
  fi
  if [ "$NETNS" = 1 ]; then net_up; fi
  write_hosts
  make_fake_gpus
  if [ -n "$ROOT" ]; then
    build_root
    root_mounts
    make_wrappers
    start_munge "$ROOT"
  else
    start_munge
  fi
  mkdir -p "$STATE/ctld" "$RUN"
  for node in $(node_names); do mkdir -p "$STATE/spool/$node"; done
  if [ "$running" = 0 ]; then
    # A fresh start clears the saved state (-c): jobs of an earlier, killed testbed must not
    # come back and hold nodes while the tests run.
    log "starting slurmctld (port $CTLD_PORT)"
    rm -f "$(ctld_pidfile)"
    # runc's state of containers a killed testbed left: a new job of the same id would collide with it.
    rm -rf --one-file-system "$RUN/runc"
    slurmctld -f "$CONF" -c
  fi
  wait_for "slurmctld" 60 scontrol ping || { tail -n 20 "$LOGS/slurmctld.log" >&2 || true; exit 1; }
  for node in $(node_names); do start_slurmd "$node"; done
  wait_for "all $NODES nodes to be idle" 120 all_nodes_idle || { sinfo -N >&2; exit 1; }
  # Nodes left DOWN/DRAIN by an earlier run (e.g. a killed slurmd) come back here.
  scontrol update NodeName="$PREFIX[1-$NODES]" State=RESUME >/dev/null 2>&1 || true
  log "up: $NODES nodes x $GPUS GPUs, partition debug ($(sinfo -h -o '%D nodes %T' | tr '\n' ' '))"
  if [ "$NAME" != default ]; then log "clients: export SLURM_CONF=$CONF"; fi
}

down() {
  local node pids=() p
  for node in $(node_names); do
    p=$(slurmd_pid "$node")
    [ -n "$p" ] && pids+=("$p")
  done
  stop_pids "slurmd" "${pids[@]}" || true
  # Job processes left behind by the slurmds of this instance (slurmstepd and tasks).
  pids=()
  for node in $(node_names); do
    for p in $(node_job_pids "$node"); do pids+=("$p"); done
  done
  if [ "${#pids[@]}" -gt 0 ]; then kill -KILL "${pids[@]}" 2>/dev/null || true; fi
  p=$(ctld_pid)
  if [ -n "$p" ]; then
    local kids
    kids=$(pgrep -P "$p" || true)
    # shellcheck disable=SC2086
    stop_pids "slurmctld" "$p" $kids || true
  fi
  if [ "$NETNS" = 1 ]; then net_down; fi
  if [ -n "$ROOT" ]; then # the instance's own mounts in the root (the shared ones stay)
    for p in "$ROOT$LOGS" "$ROOT$STATE"; do
      if mountpoint -q "$p"; then umount -l "$p" && rmdir "$p" 2>/dev/null || true; fi
    done
  fi
  for node in $(node_names); do # the cgroups task/cgroup made (leaf first)
    find /sys/fs/cgroup/*/"slurm_$node" -depth -type d -exec rmdir {} + 2>/dev/null || true
  done
  rm -rf --one-file-system "$RUN/runc" # the killed containers' state (their ids come back with the job ids)
  log "down"
}

status() {
  local node p
  echo "instance $NAME: SLURM_CONF=$CONF"
  if [ -n "$ROOT" ]; then echo "slurm: $SLURM_RELEASE from $ROOT (commands: $WRAPPERS)"; fi
  if [ "$NETNS" = 1 ]; then
    echo "network: a namespace per node (hpce-$NAME-NODE), $NET.0/24 on bridge $BRIDGE, slurmctld at $CTLD_ADDR"
  fi
  p=$(ctld_pid)
  echo "slurmctld ${p:-not running} (port $(conf_value SlurmctldPort))"
  for node in $(node_names); do
    p=$(slurmd_pid "$node")
    echo "slurmd $node ${p:-not running}"
  done
  if [ ! -r "$CONF" ]; then echo "not configured ($CONF missing): run up"; return 3; fi
  scontrol ping && sinfo -N -o '%N %T %G'
}

deepest_first() { # PID...: the same pids, each before its ancestors among them
  ps -e -o pid=,ppid= | awk -v want="$*" '
    BEGIN { n = split(want, w, " "); for (i = 1; i <= n; i++) mine[w[i]] = 1 }
    { up[$1] = $2 }
    END {
      for (p in mine) {
        d = 0
        for (q = p; (q in up) && (up[q] in mine) && d < 4096; q = up[q]) d++
        print d, p
      }
    }' | sort -k1,1nr -k2,2n | awk '{ print $2 }'
}

kill_node() { # NODE
  local node=$1 pids=() more p n
  valid_node "$node"
  need_root
  # Freeze first (so nothing forks or reacts half-way), collect again until the set is stable,
  # then SIGKILL everything in one go: the node dies as a whole.
  mapfile -t pids < <(node_pids "$node")
  for n in 1 2 3 4 5; do
    [ "${#pids[@]}" -gt 0 ] && kill -STOP "${pids[@]}" 2>/dev/null || true
    mapfile -t more < <(node_pids "$node")
    local -A seen=()
    for p in "${pids[@]}"; do seen[$p]=1; done
    local grew=0
    for p in "${more[@]}"; do
      [ -z "${seen[$p]:-}" ] && { pids+=("$p"); grew=1; }
    done
    unset seen
    [ "$grew" = 0 ] && break
  done
  if [ "${#pids[@]}" -eq 0 ]; then
    log "kill-node $node: nothing runs there"
    return 0
  fi
  # Children before parents: when a parent dies, the kernel wakes its process group's stopped members
  # (SIGHUP, SIGCONT) if the group is orphaned; a batch step's srun woken so ran on and ended the step
  # ("srun: forcing job termination"), which no real node death does. SIGKILL clears a stop at once.
  mapfile -t pids < <(deepest_first "${pids[@]}")
  kill -KILL "${pids[@]}" 2>/dev/null || true
  log "kill-node $node: SIGKILLed ${#pids[@]} processes; Slurm marks it DOWN after SlurmdTimeout=$(conf_value SlurmdTimeout)s"
  printf '%s\n' "${pids[@]}"
}

revive_node() { # NODE
  local node=$1
  valid_node "$node"
  need_root
  start_slurmd "$node"
  scontrol update NodeName="$node" State=RESUME >/dev/null 2>&1 || true
  log "revive-node $node: slurmd $(slurmd_pid "$node") $(sinfo -h -N -n "$node" -o '%T' | head -n 1)"
}

case "${1:-}" in
  install) NETNS=1 install_packages ;; # everything, the netns tools included
  up) up ;;
  down) down ;;
  restart) down; up ;;
  status) status ;;
  env)
    echo "export SLURM_CONF=$CONF"
    if [ -n "$ROOT" ]; then
      echo "export PATH=\"$WRAPPERS:\$PATH\""
    else # the host's commands: drop another instance's wrappers from the caller's PATH
      echo "export PATH=\$(printf %s \"\$PATH\" | tr : '\\n' | grep -vE '/hpcelastic-testbed-[a-z0-9]+/bin\$' | paste -sd: -)"
    fi
    ;;
  image) build_image ;;
  install-root) # the Debian root of TESTBED_SLURM (24.11), for CI's setup; nothing else
    SLURM_RELEASE=${TESTBED_SLURM:-24.11}
    set_release
    [ -n "$ROOT" ] || { log "install-root: TESTBED_SLURM=$SLURM_RELEASE runs on the host's Slurm"; exit 2; }
    build_root
    ;;
  kill-node) kill_node "${2:?usage: $0 kill-node NODE}" ;;
  revive-node) revive_node "${2:?usage: $0 revive-node NODE}" ;;
  pids) valid_node "${2:?usage: $0 pids NODE}"; node_pids "$2" ;;
  addr) valid_node "${2:?usage: $0 addr NODE}"; node_addr "$2" ;;
  exec)
    fault_checks exec "${2:-}"
    ns=$(netns_of "$2")
    shift 2
    exec nsenter --net="/run/netns/$ns" "$@"
    ;;
  cut-link) fault_checks cut-link "${2:-}"; cut_link "$2" "${3:-0}" ;;
  netem) fault_checks netem "${2:-}"; node=$2; shift 2; netem "$node" "$@" ;;
  partition) fault_checks partition "${2:-}"; node=$2; shift 2; partition "$node" "$@" ;;
  flap) fault_checks flap "${2:-}"; flap "$2" "${3:-}" "${4:-}" "${5:-}" ;;
  heal) fault_checks heal "${2:-}"; heal "$2" ;;
  _timer) shift; timer "$@" ;;
  *)
    echo "usage: [TESTBED_NAME=NAME] $0 install|up|down|restart|status|env|kill-node NODE|revive-node NODE|pids NODE|addr NODE" >&2
    echo "       netns instances: cut-link NODE [SECONDS]|netem NODE ARGS...|netem NODE off|partition NODE PEER...|flap NODE DOWN_S UP_S COUNT|heal NODE|exec NODE CMD..." >&2
    exit 2
    ;;
esac
