#!/usr/bin/env bash
# Debian's Slurm and munge for tests/test_slurm.py, which starts its own munged, slurmctld and
# slurmd on this machine (README: "Slurm").
#
#   .ci/setup_slurm.sh                       install slurmctld, slurmd, slurm-client and munge
#                                            (apt-get; nothing to do when they are there)
#   .ci/setup_slurm.sh conf DIR CTLD_PORT SLURMD_PORT FIRST_JOB_ID
#                                            write DIR/slurm.conf and DIR/munge.key for one node
#                                            on this machine, every state file under DIR
set -euo pipefail

install() {
    local missing=()
    for cmd in munged slurmctld slurmd sbatch srun scontrol; do
        command -v "$cmd" >/dev/null || missing+=("$cmd")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    echo "setup_slurm: installing Slurm and munge (missing: ${missing[*]})"
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    export DEBIAN_FRONTEND=noninteractive
    local packages=(slurmctld slurmd slurm-client munge)
    $sudo apt-get install -y -q --no-install-recommends "${packages[@]}" >/dev/null ||
        { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q --no-install-recommends "${packages[@]}" >/dev/null; }
}

# One node named localhost (it resolves everywhere: the ranks' rendezvous host is the first node's
# name) with 4 CPUs whatever the machine has (SlurmdParameters=config_overrides) and CPUs shared
# between jobs (OverSubscribe=FORCE). No cgroups: processes are tracked by parent
# (proctrack/linuxproc) and tasks are not bound (task/none), which works in containers too.
# Debian's build allows one slurmd a host, so "nodes" here are one node.
conf() {
    local dir=$1 ctld_port=$2 slurmd_port=$3 first_job_id=$4
    mkdir -p "$dir/state" "$dir/spool"
    chmod 700 "$dir"
    head -c 1024 /dev/urandom >"$dir/munge.key"
    chmod 600 "$dir/munge.key"
    cat >"$dir/slurm.conf" <<CONF
ClusterName=pipezero
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
AuthType=auth/munge
AuthInfo=socket=$dir/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
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
NodeName=localhost NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF
}

case "${1:-install}" in
    install) install ;;
    conf) [ $# -eq 5 ] || { echo "usage: $0 conf DIR CTLD_PORT SLURMD_PORT FIRST_JOB_ID" >&2; exit 2; }
          conf "$2" "$3" "$4" "$5" ;;
    *) echo "usage: $0 [install | conf DIR CTLD_PORT SLURMD_PORT FIRST_JOB_ID]" >&2; exit 2 ;;
esac
