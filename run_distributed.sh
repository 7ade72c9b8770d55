#!/usr/bin/env bash
# Train with torchrun on NUM_PROCS processes per node: one per GPU, or CPU processes (gloo) when no GPU is visible.
#
#   ./run_distributed.sh                                   # the embedded default (SFT then DPO), 2 processes, offline
#   ./run_distributed.sh 4 --config configs/<recipe>.yaml  # 4 GPUs, a recipe; any further flags override it
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 ./run_distributed.sh 8 --config ...   # on each of two nodes
#
# Environment: NNODES (1), NODE_RANK (0), MASTER_ADDR (127.0.0.1), MASTER_PORT (29500 with several nodes; a free
# port is picked on one node), MAX_RESTARTS (3: a lost worker restarts the job, which resumes from its newest complete
# checkpoint), PYTHON (python), OMP_NUM_THREADS (CPU cores / processes on CPU).
set -euo pipefail
cd "$(dirname "$0")"

NUM_PROCS=2
if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then
  NUM_PROCS=$1
  shift
fi
if [[ $NUM_PROCS -lt 1 ]]; then
  echo "error: NUM_PROCS must be at least 1, got $NUM_PROCS" >&2
  exit 2
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
PYTHON=${PYTHON:-$(command -v python || command -v python3)}

dry_run=0
for arg in "$@"; do
  [[ $arg == --dry_run ]] && dry_run=1
done
# One process first checks the configuration and the data and tokenizes it into the cache, so a mistake is one
# line (not one per rank under torchrun's failure report) and the workers start on prepared data.
WORLD_SIZE=$((NUM_PROCS * NNODES)) LOCAL_WORLD_SIZE=$NUM_PROCS RANK=$((NODE_RANK * NUM_PROCS)) LOCAL_RANK=0 \
  PREFKIT_QUIET_DRY_RUN=$((1 - dry_run)) "$PYTHON" -m src.main_distributed --dry_run "$@" || exit $?
[[ $dry_run -eq 1 ]] && exit 0  # the check was all that was asked

# On CPU, split the cores between the processes (torchrun would otherwise give each process one thread).
if [[ -z ${OMP_NUM_THREADS:-} ]]; then
  cores=$(nproc 2>/dev/null || echo 1)
  export OMP_NUM_THREADS=$(( cores / NUM_PROCS > 0 ? cores / NUM_PROCS : 1 ))
fi

if [[ -z ${MASTER_PORT:-} ]]; then
  if [[ $NNODES -eq 1 ]]; then  # one node: any free port, so several jobs can share a machine
    MASTER_PORT=$("$PYTHON" -c "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])")
  else
    MASTER_PORT=29500
  fi
fi
# Static rendezvous, also on one node: with torch 2.13, torchrun's c10d rendezvous (what --standalone uses) hands
# restarted gloo workers the dead workers' addresses, and a restarted job hangs; the static one restarts cleanly.
rendezvous=(--nnodes "$NNODES" --node_rank "$NODE_RANK" --master_addr "${MASTER_ADDR:-127.0.0.1}"
            --master_port "$MASTER_PORT")
# torchrun (python -m torch.distributed.run runs the same launcher with this interpreter).
exec "$PYTHON" -m torch.distributed.run "${rendezvous[@]}" --nproc_per_node "$NUM_PROCS" \
  --max-restarts "${MAX_RESTARTS:-3}" -m src.main_distributed "$@"
