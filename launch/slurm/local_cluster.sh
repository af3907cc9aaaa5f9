#!/usr/bin/env bash
# A one-machine Slurm cluster for trying deltarec's Slurm path locally (docs/slurm.md).
#
#   bash launch/slurm/local_cluster.sh start    # install (apt, as root) if missing, then run it
#   bash launch/slurm/local_cluster.sh status   # daemons and node state; exit 0 up, 3 not
#   bash launch/slurm/local_cluster.sh env      # the line to eval: export SLURM_CONF=...
#   bash launch/slurm/local_cluster.sh stop     # cancel its jobs, stop the daemons it started
#
# It runs munged, slurmctld and slurmd as daemons with a private configuration, key, state,
# logs and pid files under $DELTAREC_SLURM_DIR (default /var/tmp/deltarec-slurm); nothing
# under /etc is written and nothing is exported globally: clients (sbatch, srun, squeue,
# scontrol) need SLURM_CONF=$DELTAREC_SLURM_DIR/slurm.conf, which `status` and `env` print.
# Every daemon is pinned to 127.0.0.1 (SlurmctldHost=<host>(127.0.0.1), NodeAddr=127.0.0.1)
# whatever the host name resolves to. Ports: $DELTAREC_SLURM_CTLD_PORT (default 16817) and
# $DELTAREC_SLURM_SLURMD_PORT (default 16818), away from a system Slurm's 6817/6818.
#
# Idempotent: `start` with its daemons alive says so and does nothing; `stop` signals only
# the pids recorded in the state dir (daemons this script started), never a daemon by name.
set -euo pipefail

PROG="local_cluster.sh"
DIR="${DELTAREC_SLURM_DIR:-/var/tmp/deltarec-slurm}"
CTLD_PORT="${DELTAREC_SLURM_CTLD_PORT:-16817}"
SLURMD_PORT="${DELTAREC_SLURM_SLURMD_PORT:-16818}"
START_TIMEOUT_S="${DELTAREC_SLURM_START_TIMEOUT_S:-60}"
ADDR=127.0.0.1
CONF="$DIR/slurm.conf"
MUNGE_SOCKET="$DIR/munge/munge.socket"
NODE="$(hostname -s)"
DAEMONS=(munged slurmctld slurmd) # start order; stop is the reverse
export SLURM_CONF="$CONF"         # this script's own clients (scontrol, sinfo, squeue, scancel)

say() { echo "$PROG: $*"; }
die() {
  echo "$PROG: $*" >&2
  exit 1
}

pid_file() { echo "$DIR/run/$1.pid"; }

# The pid recorded for daemon $1 when that process is alive and is that program; else fails.
live_pid() {
  local f pid
  f="$(pid_file "$1")"
  [[ -s $f ]] || return 1
  pid="$(tr -dc '0-9' <"$f")"
  [[ -n $pid ]] || return 1
  [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$1" ]] || return 1
  echo "$pid"
}

# --- installation ---------------------------------------------------------------------------

POLICY=/usr/sbin/policy-rc.d
MADE_POLICY=""
drop_policy() {
  if [[ -n $MADE_POLICY ]]; then
    rm -f "$POLICY"
    MADE_POLICY=""
  fi
}

have_slurm() {
  local b
  for b in munged slurmctld slurmd sbatch srun scontrol sinfo squeue scancel; do
    command -v "$b" >/dev/null 2>&1 || return 1
  done
}

install_slurm() {
  have_slurm && return 0
  [[ $(id -u) -eq 0 ]] || die "needs root to install slurm-wlm and munge; run as root or install them yourself"
  command -v apt-get >/dev/null 2>&1 ||
    die "slurm-wlm is not installed and there is no apt-get here; install slurm (slurmctld, slurmd, clients) and munge yourself"
  mkdir -p "$DIR"
  say "installing slurm-wlm and munge with apt-get (a minute or two; log in $DIR/apt.log)"
  # Packages must not start their services (there may be no init system, and this cluster
  # runs its own daemons): a policy-rc.d answering 101 stops invoke-rc.d and
  # deb-systemd-invoke. One already in place is the admin's and is left as it is.
  if [[ ! -e $POLICY ]]; then
    MADE_POLICY=1
    trap drop_policy EXIT
    printf '#!/bin/sh\n# written by deltarec local_cluster.sh during apt-get install; removed after\nexit 101\n' >"$POLICY"
    chmod 755 "$POLICY"
  fi
  local apt=(env DEBIAN_FRONTEND=noninteractive apt-get -y -q -o Dpkg::Options::=--force-confold)
  if ! apt-cache policy slurm-wlm 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    "${apt[@]}" update >"$DIR/apt.log" 2>&1 || die "apt-get update failed; see $DIR/apt.log"
  fi
  "${apt[@]}" install --no-install-recommends slurm-wlm munge >>"$DIR/apt.log" 2>&1 ||
    die "apt-get install slurm-wlm munge failed; see $DIR/apt.log"
  drop_policy
  have_slurm || die "slurm-wlm and munge are installed but a program is missing (munged, slurmctld, slurmd, sbatch, ...)"
  say "installed $(slurmctld -V 2>/dev/null || echo slurm) and munge"
}

# --- configuration --------------------------------------------------------------------------

# CommunicationParameters for the listening sockets. Slurm binds either to every address or,
# with NoInAddrAny/NoCtldInAddrAny, to the one the host name resolves to. Only when that is
# 127.0.0.1 can the daemons, srun and slurmstepd bind to 127.0.0.1 alone; otherwise they must
# listen on all addresses to be reachable on 127.0.0.1 (they are still addressed there only).
bind_params() {
  local resolved
  resolved="$(getent ahostsv4 "$(hostname)" 2>/dev/null | awk 'NR == 1 { print $1 }')"
  if [[ $resolved == "$ADDR" ]]; then
    echo "CommunicationParameters=NoCtldInAddrAny,NoInAddrAny"
  else
    echo "# $(hostname) resolves to ${resolved:-nothing}, not $ADDR: listening on all addresses"
  fi
}

write_config() {
  local cpus mem_mb real_mb
  cpus="$(nproc)"
  mem_mb="$(awk '/^MemTotal:/ { print int($2 / 1024) }' /proc/meminfo)"
  real_mb=$((mem_mb * 9 / 10)) # leave some for the OS: a node claiming more than it has is drained
  mkdir -p "$DIR"/{run,log,state,spool/slurmd,munge}
  chmod 700 "$DIR/state" "$DIR/spool"
  chmod 755 "$DIR" "$DIR/munge" # munged wants its socket's directory readable by all
  if [[ ! -s $DIR/munge/munge.key ]]; then
    (umask 077 && head -c 1024 /dev/urandom >"$DIR/munge/munge.key")
  fi
  chmod 600 "$DIR/munge/munge.key"
  local tmp="$CONF.tmp"
  cat >"$tmp" <<EOF
# Written by launch/slurm/local_cluster.sh: a one-node cluster on 127.0.0.1 for deltarec.
# Rewritten at every start while its daemons are down; edits are lost.
ClusterName=deltarec-local
# Pinned to the loopback address, whatever "$NODE" resolves to.
SlurmctldHost=$NODE($ADDR)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
$(bind_params)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/slurmd
SlurmctldPidFile=$(pid_file slurmctld)
SlurmdPidFile=$(pid_file slurmd)
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig=$DIR/plugstack.conf
# No cgroups in a container: processes tracked through their parents, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
# CPUs are the consumable resource; memory is not tracked.
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# No accounting daemon.
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MailProg=/bin/true
# A node that was down (this machine restarted) comes back as soon as its slurmd registers.
ReturnToService=2
SlurmdParameters=config_overrides
# Short grace (SIGTERM to SIGKILL). Finished jobs are forgotten after 4 s: sbatch --wait
# then polls every 2 s (it waits up to 32 s between polls when MinJobAge allows it).
KillWait=5
MinJobAge=4
InactiveLimit=0
Waittime=0
SlurmctldTimeout=30
SlurmdTimeout=60
NodeName=$NODE NodeAddr=$ADDR NodeHostname=$NODE CPUs=$cpus RealMemory=$real_mb State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
  : >"$DIR/plugstack.conf" # no SPANK plugins (the system's plugstack.conf is not read)
  mv "$tmp" "$CONF"
}

# --- starting -------------------------------------------------------------------------------

# Wait up to $START_TIMEOUT_S for command "$@" to succeed; fails after that.
wait_for() {
  local deadline=$((SECONDS + START_TIMEOUT_S))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || return 1
    sleep 0.5
  done
}

log_tail() { tail -n 5 "$DIR/log/$1.log" 2>/dev/null | sed "s/^/  $1.log: /" >&2 || true; }

start_daemon() {
  local name="$1" pid
  if pid="$(live_pid "$name")"; then
    say "$name already running (pid $pid)"
    return 0
  fi
  rm -f "$(pid_file "$name")"
  case "$name" in
  munged)
    rm -f "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock"
    munged --socket="$MUNGE_SOCKET" --key-file="$DIR/munge/munge.key" --pid-file="$(pid_file munged)" \
      --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed" \
      </dev/null >>"$DIR/log/munged.out" 2>&1 ||
      die "munged did not start; see $DIR/log/munged.log and munged.out"
    wait_for munge_works || {
      log_tail munged
      die "munged started but munge -n | unmunge fails on $MUNGE_SOCKET; see $DIR/log/munged.log"
    }
    ;;
  slurmctld)
    slurmctld -f "$CONF" </dev/null >>"$DIR/log/slurmctld.out" 2>&1 ||
      die "slurmctld did not start; see $DIR/log/slurmctld.log"
    wait_for scontrol ping || {
      log_tail slurmctld
      die "slurmctld does not answer on $ADDR:$CTLD_PORT within ${START_TIMEOUT_S}s; see $DIR/log/slurmctld.log"
    }
    ;;
  slurmd)
    slurmd -f "$CONF" -N "$NODE" </dev/null >>"$DIR/log/slurmd.out" 2>&1 ||
      die "slurmd did not start; see $DIR/log/slurmd.log"
    ;;
  esac
  wait_for live_pid "$name" || {
    log_tail "$name"
    die "$name exited right after starting; see $DIR/log/$name.log"
  }
  say "started $name (pid $(live_pid "$name"))"
}

munge_works() { munge -n -S "$MUNGE_SOCKET" | unmunge -S "$MUNGE_SOCKET"; }

node_state() { sinfo -h -n "$NODE" -o %T 2>/dev/null | head -n 1; }

node_usable() {
  local s
  s="$(node_state)"
  [[ $s =~ ^(idle|mixed|allocated|completing)$ ]]
}

start() {
  local d all_up=1
  for d in "${DAEMONS[@]}"; do
    live_pid "$d" >/dev/null || all_up=""
  done
  if [[ -n $all_up ]]; then
    say "already running (munged $(live_pid munged), slurmctld $(live_pid slurmctld), slurmd $(live_pid slurmd)); node $NODE $(node_state)"
    echo "export SLURM_CONF=$CONF"
    return 0
  fi
  install_slurm
  [[ $(id -u) -eq 0 ]] || die "needs root to run slurmd (it starts jobs as their users); run as root"
  if ! live_pid slurmctld >/dev/null && ! live_pid slurmd >/dev/null; then
    write_config
    say "wrote $CONF (node $NODE at $ADDR: $(nproc) CPUs; ports $CTLD_PORT, $SLURMD_PORT)"
  else
    say "keeping $CONF: some of its daemons are running"
  fi
  for d in "${DAEMONS[@]}"; do
    start_daemon "$d"
  done
  if ! wait_for node_usable; then
    if [[ $(node_state) == *drain* ]]; then
      say "node $NODE is drained from an earlier run; resuming it"
      scontrol update NodeName="$NODE" State=RESUME || true
    fi
    wait_for node_usable || {
      log_tail slurmd
      die "node $NODE is '$(node_state)', not idle, ${START_TIMEOUT_S}s after start; see $DIR/log/slurmd.log"
    }
  fi
  say "up: node $NODE $(node_state), partition debug; clients need:"
  echo "export SLURM_CONF=$CONF"
}

# --- stopping -------------------------------------------------------------------------------

stop_daemon() {
  local name="$1" pid i
  if ! pid="$(live_pid "$name")"; then
    say "$name not running"
    rm -f "$(pid_file "$name")"
    return 0
  fi
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 100; i++)); do # 20 s
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.2
  done
  if kill -0 "$pid" 2>/dev/null; then
    say "$name (pid $pid) ignored SIGTERM for 20 s; killing it"
    kill -KILL "$pid" 2>/dev/null || true
    sleep 0.2
  fi
  rm -f "$(pid_file "$name")"
  say "stopped $name (pid $pid)"
}

cancel_jobs() {
  local jobs i
  jobs="$(squeue -h -o %i 2>/dev/null | paste -sd ' ')" || return 0
  [[ -n ${jobs// /} ]] || return 0
  say "cancelling jobs still in the cluster: $jobs"
  # shellcheck disable=SC2086  # one argument per job id
  scancel $jobs 2>/dev/null || true
  for ((i = 0; i < 100; i++)); do # 20 s: KillWait is 5 s
    [[ -z "$(squeue -h -o %i 2>/dev/null)" ]] && return 0
    sleep 0.2
  done
  say "jobs still listed after 20 s: $(squeue -h -o '%i %T' 2>/dev/null | paste -sd ',')"
}

stop() {
  local i
  if live_pid slurmctld >/dev/null && live_pid slurmd >/dev/null; then
    cancel_jobs
  fi
  for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do
    stop_daemon "${DAEMONS[i]}"
  done
}

# --- status ---------------------------------------------------------------------------------

status() {
  local d pid up=1 state
  for d in "${DAEMONS[@]}"; do
    if pid="$(live_pid "$d")"; then
      say "$d running (pid $pid)"
    else
      say "$d not running"
      up=""
    fi
  done
  if live_pid slurmctld >/dev/null; then
    state="$(node_state)"
    say "node $NODE: ${state:-unknown}"
    node_usable || up=""
  fi
  echo "export SLURM_CONF=$CONF"
  [[ -n $up ]] || return 3
}

case "${1:-}" in
start) start ;;
stop) stop ;;
status) status ;;
env) echo "export SLURM_CONF=$CONF" ;;
*)
  echo "usage: $0 start|stop|status|env   (state in \$DELTAREC_SLURM_DIR, default /var/tmp/deltarec-slurm)" >&2
  exit 2
  ;;
esac
