#!/usr/bin/env bash
# The local demo: a fleet of simulated GPU nodes, a double-bit ECC error that
# drains a node, an agent killed with SIGKILL, a real DDP training job on the
# healthy nodes, and the events that explain it all.
# Run it with `make demo` (which puts the project's venv on PATH).
set -euo pipefail

DIR=${PHALANX_LOCAL_DIR:-.phalanx-local}
now() { python3 -c 'import time; print(time.time())'; }
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
state_of() {  # state_of NODE -> prints the node's state
    phalanx nodes -o json | python3 -c "import json,sys; print({n['id']: n['state'] for n in json.load(sys.stdin)}['$1'])"
}
wait_state() {  # wait_state NODE STATE
    for _ in $(seq 1 100); do
        [ "$(state_of "$1")" = "$2" ] && return 0
        sleep 0.1
    done
    echo "demo: $1 did not become $2" >&2
    return 1
}

phalanx local down --dir "$DIR" 2>/dev/null || true
trap 'say "stopping the fleet"; phalanx local down --dir "$DIR"' EXIT

say "bringing up a local fleet: broker, supervisor, 4 agents x 4 simulated GPUs in 2 racks"
phalanx local up --nodes 4 --gpus-per-node 4 --dir "$DIR"
eval "$(phalanx local env --dir "$DIR")"
phalanx local status --dir "$DIR"

say "the fleet as the supervisor sees it"
phalanx nodes

say "injecting a double-bit ECC error into n03 GPU 1"
start=$(now)
phalanx local inject --dir "$DIR" --node n03 --gpu 1 --fault ecc-dbe
wait_state n03 drain
printf 'n03 drained %.2fs after the fault\n' "$(python3 -c "print($(now) - $start)")"
phalanx nodes

say "an operator cannot undrain a node that is still sick (exit code 4)"
phalanx undrain n03 || echo "(exit code $?)"

say "killing n04's agent with SIGKILL: the broker publishes its last will"
pid=$(phalanx local status --dir "$DIR" -o json | python3 -c "import json,sys; print([p['pid'] for p in json.load(sys.stdin) if p['node'] == 'n04'][0])")
start=$(now)
kill -9 "$pid"
wait_state n04 offline
printf 'n04 offline %.2fs after SIGKILL\n' "$(python3 -c "print($(now) - $start)")"
phalanx nodes

say "training a small transformer on 2 nodes x 2 ranks (examples/tinylm.yaml)"
job=$(phalanx submit examples/tinylm.yaml)
phalanx logs "$job" --rank 0 -f
phalanx status "$job"

say "its checkpoints (every 50 steps), and the tiers that hold them"
phalanx ckpt ls "$job"

say "the event log"
phalanx events --limit 25
