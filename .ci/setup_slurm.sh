#!/usr/bin/env bash
# Debian's Slurm and munge for tests/test_slurm.py, which starts its own munged, slurmctld and a
# slurmd on each of two nodes emulated on this machine (tests/local_slurm.py; README: "Slurm").
#
#   .ci/setup_slurm.sh                       install slurmctld, slurmd, slurm-client and munge, and
#                                            iproute2 and util-linux for the nodes' namespaces
#                                            (apt-get; nothing to do when they are there)
#   .ci/setup_slurm.sh conf DIR CTLD_PORT SLURMD_PORT FIRST_JOB_ID NAME=ADDR...
#                                            write DIR/slurm.conf and DIR/munge.key for the nodes
#                                            NAME at ADDR (slurmctld on the first), every state
#                                            file under DIR
set -euo pipefail

install() {
    local missing=()
    for cmd in munged slurmctld slurmd sbatch srun scontrol ip tc nsenter unshare; do
        command -v "$cmd" >/dev/null || missing+=("$cmd")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    echo "setup_slurm: installing Slurm and munge (missing: ${missing[*]})"
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    export DEBIAN_FRONTEND=noninteractive
    local packages=(slurmctld slurmd slurm-client munge iproute2 util-linux)
    $sudo apt-get install -y -q --no-install-recommends "${packages[@]}" >/dev/null ||
        { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q --no-install-recommends "${packages[@]}" >/dev/null; }
}

# Each node NAME at ADDR has 4 CPUs whatever the machine has (SlurmdParameters=config_overrides)
# and shares them between jobs (OverSubscribe=FORCE); slurmctld runs on the first node. Each slurmd
# has its own spool, pid and log file (%n: its node name). No cgroups: processes are tracked by
# parent (proctrack/linuxproc) and tasks are not bound (task/none), which works in containers too.
# Debian's slurmd is built for one slurmd a host name (no --enable-multiple-slurmd): several nodes
# on one machine need a host name and an address each (tests/test_slurm.py: a network and a UTS
# namespace a node).
conf() {
    local dir=$1 ctld_port=$2 slurmd_port=$3 first_job_id=$4
    shift 4
    local head=${1%%=*} head_addr=${1#*=} nodes="" node
    for node in "$@"; do
        [[ $node =~ ^[A-Za-z][A-Za-z0-9-]*=[0-9.]+$ ]] || { echo "setup_slurm: '$node' is not NAME=ADDR" >&2; exit 2; }
        nodes+="NodeName=${node%%=*} NodeAddr=${node#*=} CPUs=4 State=UNKNOWN"$'\n'
    done
    mkdir -p "$dir/state"
    for node in "$@"; do mkdir -p "$dir/spool-${node%%=*}"; done
    chmod 700 "$dir"
    head -c 1024 /dev/urandom >"$dir/munge.key"
    chmod 600 "$dir/munge.key"
    cat >"$dir/slurm.conf" <<CONF
ClusterName=pipezero
SlurmctldHost=$head($head_addr)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
AuthType=auth/munge
AuthInfo=socket=$dir/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool-%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
FirstJobId=$first_job_id
KillWait=5
InactiveLimit=0
MinJobAge=60
${nodes}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF
}

case "${1:-install}" in
    install) install ;;
    conf) [ $# -ge 6 ] || { echo "usage: $0 conf DIR CTLD_PORT SLURMD_PORT FIRST_JOB_ID NAME=ADDR..." >&2; exit 2; }
          shift; conf "$@" ;;
    *) echo "usage: $0 [install | conf DIR CTLD_PORT SLURMD_PORT FIRST_JOB_ID NAME=ADDR...]" >&2; exit 2 ;;
esac
