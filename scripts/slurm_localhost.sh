#!/usr/bin/env bash
# scripts/slurm_build.sbatch run for real: a one-node Slurm cluster on this machine (Debian's
# slurm-wlm and munge, run as root), a two-task array job with the merge as a dependent job, then a
# requeue of a task that had finished. Everything it makes is under WORKDIR; it stops the daemons
# it started. Usage (from a clone whose .venv has helixtok):
#   apt-get install -y slurm-wlm munge
#   scripts/slurm_localhost.sh CORPUS TOKENIZER WORKDIR
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
CORPUS="$(realpath "$1")" TOK="$(realpath "$2")" W="$(realpath -m "$3")"
command -v slurmd >/dev/null || { echo "needs Debian's slurm-wlm and munge: apt-get install slurm-wlm munge" >&2; exit 1; }
[ ! -e "$W" ] || { echo "$W exists: give a new folder" >&2; exit 1; }
mkdir -p "$W"/{state,spool,log}
H="$(hostname)"
cat > "$W/slurm.conf" <<EOF
ClusterName=helixtok
SlurmctldHost=$H
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$W/state
SlurmdSpoolDir=$W/spool
SlurmctldPidFile=$W/slurmctld.pid
SlurmdPidFile=$W/slurmd.pid
SlurmctldLogFile=$W/log/slurmctld.log
SlurmdLogFile=$W/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
NodeName=$H CPUs=$(nproc) RealMemory=$(free -m | awk '/^Mem:/ {print $2}') State=UNKNOWN
PartitionName=local Nodes=$H Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF="$W/slurm.conf" PATH="$REPO/.venv/bin:$PATH"
if ! munge -n >/dev/null 2>&1; then
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown -R munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge
    su -s /bin/sh munge -c munged
fi
slurmctld -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"
trap 'kill $(cat "$W/slurmd.pid" "$W/slurmctld.pid" 2>/dev/null) 2>/dev/null || true' EXIT
for _ in $(seq 50); do sinfo -h -o %t 2>/dev/null | grep -q idle && break; sleep 0.2; done

wait_for() {  # until none of the given jobs is pending or running
    while squeue -h -j "$1" 2>/dev/null | grep -q .; do sleep 1; done
}
say() { echo "+ $*" >&2; }

cd "$W"
start=$(date +%s)
# The example as a user runs it; one CPU and 1 GiB a task on this small node instead of its 32 and 16G.
# --shard-size 4MiB: shards of a few MB, so that a corpus of ~10 MB gives both tasks shards of their own.
say sbatch --array=0-1 -c 1 --mem=1G scripts/slurm_build.sbatch 2 CORPUS "$W/out" TOKENIZER --shard-size 4MiB
job=$(sbatch --parsable --array=0-1 -c 1 --mem=1G "$REPO/scripts/slurm_build.sbatch" 2 "$CORPUS" "$W/out" "$TOK" \
    --shard-size 4MiB)
say sbatch --dependency=afterok:"$job" --wrap "helixtok merge out/part-* out"
merge=$(sbatch --parsable --dependency=afterok:"$job" -c 1 --mem=1G -o merge-%j.log \
    --wrap "helixtok merge $W/out/part-00000 $W/out/part-00001 $W/out")
wait_for "$job,$merge"
sacct -n -X -j "$job,$merge" -o JobID,State,ExitCode 2>/dev/null || squeue --states=all -j "$job,$merge" || true
for f in helixtok-*.log merge-*.log; do echo "===== $f" >&2; cat "$f" >&2; done
say scontrol requeue "${job}_0"   # a task that had finished, run again (a node failure, a requeue policy)
scontrol requeue "${job}_0"
sleep 2
wait_for "$job"
echo "===== helixtok-${job}_0.log after the requeue" >&2
cat "helixtok-${job}_0.log" >&2
# One index submitted alone (a failed task resubmitted): N is an argument, so it is still task 1 of 2.
say sbatch --array=1 -c 1 --mem=1G scripts/slurm_build.sbatch 2 CORPUS "$W/out" TOKENIZER --shard-size 4MiB
again=$(sbatch --parsable --array=1 -c 1 --mem=1G -o again-%A_%a.log "$REPO/scripts/slurm_build.sbatch" 2 "$CORPUS" \
    "$W/out" "$TOK" --shard-size 4MiB)
wait_for "$again"
for f in again-*.log; do echo "===== $f" >&2; cat "$f" >&2; done
say helixtok verify out
helixtok verify "$W/out" >&2
echo "slurm_localhost: done in $(( $(date +%s) - start )) s; everything is in $W" >&2
