#!/usr/bin/env bash
# The local demo: the heart of Phalanx. A small transformer trains with DDP on 2 nodes x 2
# ranks of a fleet of simulated GPU nodes with a hot spare, checkpointing to RAM, NVMe, a
# buddy node and an object store. Mid-run one rank is killed with SIGKILL: the gang restarts
# in place from its RAM. Then a GPU of a job node reports a double-bit ECC error: the node is
# drained, the spare takes its ranks and restores from the peer copy or the object store.
# The job succeeds, and the demo prints each recovery with its phases.
# Run it with `make demo` (which puts the project's venv on PATH).
set -euo pipefail

DIR=${PHALANX_LOCAL_DIR:-.phalanx-local}
# Bold headings on a terminal only: the demo's log (`make demo > demo.log`, CI) is plain
# text, and NO_COLOR (no-color.org) turns them off on a terminal too.
bold='' plain=''
if [ -t 1 ] && [ -z "${NO_COLOR:-}" ]; then bold=$'\033[1m' plain=$'\033[0m'; fi
say() { printf '\n%s== %s%s\n' "$bold" "$*" "$plain"; }
job_field() {  # job_field JOB EXPR -> prints EXPR evaluated on the job's JSON as `j`
    phalanx status "$1" -o json | python3 -c "import json,sys; j=json.load(sys.stdin); print($2)"
}
wait_until() {  # wait_until SECONDS WHAT COMMAND...: poll COMMAND until it succeeds
    local limit=$1 what=$2
    shift 2
    for _ in $(seq 1 $((limit * 5))); do
        "$@" >/dev/null 2>&1 && return 0
        sleep 0.2
    done
    echo "demo: gave up after ${limit}s waiting for $what" >&2
    return 1
}
committed() {  # committed JOB STEP: STEP or a later one is committed at every tier
    phalanx ckpt ls "$1" -o json | python3 -c "
import json, sys
steps = json.load(sys.stdin)['steps']
sys.exit(0 if any(s['step'] >= $2 and len(s['committed']) == 4 for s in steps) else 1)"
}
running_generation() {  # running_generation JOB GEN: the job runs generation GEN or later
    [ "$(job_field "$1" "j['state'] == 'running' and j['generation'] >= $2")" = True ]
}
succeeded() { [ "$(job_field "$1" "j['state']")" = succeeded ]; }
warm_ready() {  # warm_ready JOB: every rank slot of the job's nodes has a warm interpreter
    phalanx status "$1" -o json | python3 -c "
import json, pathlib, re, sys
job = json.load(sys.stdin)
ready = re.compile(r'job ' + re.escape(job['id']) + r' local rank (\d+): warm interpreter ready')
slots = set()
for node in set(job['nodes']):
    log = pathlib.Path('$DIR/logs/agent-' + node + '.log')
    text = log.read_text(errors='replace') if log.exists() else ''
    slots.update((node, m) for m in ready.findall(text))
sys.exit(0 if len(slots) >= job['world_size'] else 1)"
}
rank_pid() {  # rank_pid JOB RANK -> the pid of that rank's process
    python3 - "$1" "$2" <<'EOF'
import pathlib, sys
for proc in pathlib.Path("/proc").iterdir():
    try:
        env = dict(e.split("=", 1) for e in (proc / "environ").read_text().split("\0") if "=" in e)
    except (OSError, ValueError):
        continue
    if env.get("PHALANX_JOB_ID") == sys.argv[1] and env.get("RANK") == sys.argv[2]:
        print(proc.name)
        break
EOF
}

phalanx local down --dir "$DIR" 2>/dev/null || true
trap 'say "stopping the fleet"; phalanx local down --dir "$DIR"' EXIT

say "bringing up a local fleet: broker, supervisor, 4 agents x 4 simulated GPUs in 2 racks, 1 hot spare"
phalanx local up --nodes 4 --gpus-per-node 4 --spares 1 --dir "$DIR"
eval "$(phalanx local env --dir "$DIR")"
phalanx nodes
say "the web dashboard, while the demo runs: $PHALANX_API/ui/ (the token: $DIR/token)"

say "training a small transformer on 2 nodes x 2 ranks, a checkpoint every 20 steps"
spec="$DIR/demo-job.yaml"
cat > "$spec" <<EOF
name: tinylm
team: research
command: [python, $PWD/examples/tinylm.py, --steps, "240", --log-every, "40", --ckpt-every, "20",
          --step-sleep, "0.05"]
workdir: $PWD/examples
env: {OMP_NUM_THREADS: "1"}
nodes: 2
ranks_per_node: 2
max_runtime: 15m
grace_period: 10
checkpoint: {interval: {steps: 20}, tiers: [ram, nvme, peer, object]}
restart: {max_restarts: 3, use_spares: true}
EOF
job=$(phalanx submit "$spec")
wait_until 60 "the job to run" running_generation "$job" 1
wait_until 120 "step 40 to be committed" committed "$job" 40
phalanx ckpt ls "$job"
# A restart hands each rank a warm interpreter (torch imported ahead): on a slow machine
# their imports may take longer than the first checkpoint. Waited for, up to a minute;
# without them the restart is a cold launch, which `phalanx status` then says.
wait_until 60 "the warm interpreters" warm_ready "$job" || true

say "killing rank 3 with SIGKILL: the gang restarts in place, from its own RAM"
kill -9 "$(rank_pid "$job" 3)"
wait_until 120 "generation 2 to run" running_generation "$job" 2
phalanx jobs
wait_until 120 "step 120 to be committed" committed "$job" 120

victim=$(job_field "$job" "j['nodes'][1]")
say "a double-bit ECC error on $victim GPU 0: $victim is drained, the spare takes its ranks"
phalanx local inject --dir "$DIR" --node "$victim" --gpu 0 --fault ecc-dbe
wait_until 120 "generation 3 to run" running_generation "$job" 3
phalanx nodes

say "the job runs to the end"
phalanx logs "$job" --rank 0 -f
wait_until 60 "the job to succeed" succeeded "$job"

say "the job, its generations and each recovery's phases"
phalanx status "$job"

say "the event log, checkpoint commits left out"
phalanx events --limit 300 | grep -v ckpt_committed | tail -n 30
