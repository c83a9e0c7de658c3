#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for the tests and for trying kvlab's SLURM
# launcher without a cluster: Debian's slurm-wlm and munge, slurmctld + slurmd on this
# host, partition "debug" over this host's CPUs and memory, no accounting database.
#
#   scripts/slurm_local.sh start    # install (apt, as root) where missing, start, wait idle
#   scripts/slurm_local.sh status   # sinfo
#   scripts/slurm_local.sh stop
#
# Exit status 3: SLURM cannot be had here (not root and not installed, or apt failed);
# the reason is printed on stderr (the tests skip with it).
set -euo pipefail

CONF_DIR=/etc/slurm
STATE_DIR=/var/lib/slurm-kvlab
LOG_DIR=/var/log/slurm-kvlab

unavailable() { echo "slurm_local: $*" >&2; exit 3; }

install() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
    && return 0
  [ "$(id -u)" = 0 ] || unavailable "slurm-wlm is not installed and installing it needs root"
  command -v apt-get >/dev/null || unavailable "slurm-wlm is not installed and there is no apt-get"
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update -q && apt-get install -y -q --no-install-recommends slurm-wlm munge; } \
    >"${TMPDIR:-/tmp}/slurm_local_apt.log" 2>&1 \
    || unavailable "apt-get install slurm-wlm munge failed (see ${TMPDIR:-/tmp}/slurm_local_apt.log)"
}

start_munge() {
  pgrep -x munged >/dev/null && return 0
  mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
  if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
  fi
  chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge
  chmod 0700 /etc/munge && chmod 0400 /etc/munge/munge.key
  runuser -u munge -- munged
}

write_conf() {
  local host cpus memory_mb
  host=$(hostname -s)
  cpus=$(nproc --all)
  memory_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 9 / 10 ))
  mkdir -p "$CONF_DIR" "$STATE_DIR/ctld" "$STATE_DIR/d" "$LOG_DIR"
  # written beside and renamed into place: a daemon never reads a half-written (empty) file
  cat >"$CONF_DIR/slurm.conf.new" <<EOF
# written by kvlab's scripts/slurm_local.sh: one node, this host
ClusterName=kvlab-local
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
StateSaveLocation=$STATE_DIR/ctld
SlurmdSpoolDir=$STATE_DIR/d
SlurmctldPidFile=/run/slurmctld-kvlab.pid
SlurmdPidFile=/run/slurmd-kvlab.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
KillWait=5
SlurmdParameters=config_overrides
SchedulerParameters=defer
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$memory_mb State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
  mv -f "$CONF_DIR/slurm.conf.new" "$CONF_DIR/slurm.conf"
  echo "$host"
}

wait_idle() {
  local host=$1
  for _ in $(seq 60); do
    state=$(sinfo -h -n "$host" -o %T 2>/dev/null || true)
    case "$state" in
      idle*|mixed*|allocated*) echo "slurm_local: node $host $state"; return 0 ;;
      down*|drain*) scontrol update nodename="$host" state=resume >/dev/null 2>&1 || true ;;
    esac
    sleep 1
  done
  unavailable "node $host did not become idle (sinfo: '${state:-nothing}'; logs in $LOG_DIR)"
}

start() {
  install
  start_munge
  local host
  host=$(write_conf)
  pgrep -x slurmctld >/dev/null || slurmctld
  pgrep -x slurmd >/dev/null || slurmd
  wait_idle "$host"
}

stop() {
  scontrol shutdown >/dev/null 2>&1 || true
  for daemon in slurmd slurmctld; do pkill -x "$daemon" 2>/dev/null || true; done
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) sinfo ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
