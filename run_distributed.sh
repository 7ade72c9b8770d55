#!/usr/bin/env bash
# Train with torchrun on NUM_PROCS processes per node: one per GPU, or CPU processes (gloo) when no GPU is visible.
#
#   ./run_distributed.sh                                   # the embedded default (SFT then DPO), 2 processes, offline
#   ./run_distributed.sh 4 --config configs/<recipe>.yaml  # 4 GPUs, a recipe; any further flags override it
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 ./run_distributed.sh 8 --config ...   # on each of two nodes
#
#   STRATEGY=zero3 ./run_distributed.sh 8 --config ...    # accelerate launch with configs/accelerate/zero3.yaml
#
# Environment: NNODES (1), NODE_RANK (0), MASTER_ADDR (127.0.0.1), MASTER_PORT (29500 with several nodes; a free
# port is picked on one node), MAX_RESTARTS (3: a lost worker restarts the job, which resumes from its newest complete
# checkpoint), STRATEGY (torchrun: plain DDP; or ddp, zero1, zero2, zero3, fsdp: accelerate launch with
# configs/accelerate/<STRATEGY>.yaml), PRINT_LAUNCH=1 (print the launch command instead of running it),
# PYTHON (python), OMP_NUM_THREADS (usable CPU cores / processes on CPU), GLOO_SOCKET_IFNAME (with several nodes: the
# interface that reaches MASTER_ADDR).
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
# The launch environment, checked before anything starts: torchrun reports these late or not at all (a node rank
# beyond the node count waits at the rendezvous for a node that never comes), and bash names a word in NNODES an
# unbound variable.
for name in NNODES NODE_RANK MASTER_PORT MAX_RESTARTS; do
  if [[ -n ${!name:-} && ! ${!name} =~ ^[0-9]+$ ]]; then
    echo "error: $name must be a whole number, got '${!name}'" >&2
    exit 2
  fi
done
if [[ $NNODES -lt 1 || $NODE_RANK -ge $NNODES ]]; then
  echo "error: NODE_RANK $NODE_RANK with NNODES $NNODES: NNODES is the number of machines (at least 1) and each" \
       "machine's NODE_RANK is a different number from 0 to NNODES - 1" >&2
  exit 2
fi
if [[ -n ${MASTER_PORT:-} ]] && (( MASTER_PORT < 1 || MASTER_PORT > 65535 )); then
  echo "error: MASTER_PORT must be a port number from 1 to 65535, got $MASTER_PORT" >&2
  exit 2
fi
PYTHON=${PYTHON:-$(command -v python || command -v python3)}

STRATEGY=${STRATEGY:-torchrun}
case $STRATEGY in
  torchrun) ;;
  ddp|zero1|zero2|zero3|fsdp)
    # DeepSpeed (zero1-3) runs on CUDA GPUs and on CPU processes alike; what a strategy needs and cannot combine
    # with is checked by the preflight below (src/engines.py, with the config), before any worker starts.
    ;;
  *)
    echo "error: STRATEGY=$STRATEGY: use torchrun (default), ddp, zero1, zero2, zero3 or fsdp" >&2
    exit 2 ;;
esac

dry_run=0
for arg in "$@"; do
  [[ $arg == --dry_run ]] && dry_run=1
done
# A stop the job chose (a user error, divergence, a full disk, a lost node: src/run_safety/launcher_exit.py) is recorded
# here by the workers, who then exit 0 so torchrun neither restarts them nor prints its failure report; this script
# exits with the recorded status (docs/reliability.md lists them). A crash keeps torchrun's restarts and report.
if [[ ${PRINT_LAUNCH:-0} != 1 ]]; then
  # A launch killed with -9 cannot remove its directory: the next launch removes those whose launcher is gone (its
  # pid no longer runs, or runs another process since: /proc's start time differs). Linux; elsewhere they stay. Only
  # those of this machine (boot id) and PID namespace: a TMPDIR shared with another container or machine holds
  # launches whose pids mean nothing here, left to their own.
  process_start() {  # the start time of a pid (field 22 of /proc/PID/stat, after the command name's parentheses)
    local stat
    { stat=$(<"/proc/$1/stat"); } 2>/dev/null || return 0
    stat=${stat##*) }
    read -r -a stat <<<"$stat"
    echo "${stat[19]}"
  }
  here="$(readlink /proc/self/ns/pid 2>/dev/null || true)@$(cat /proc/sys/kernel/random/boot_id 2>/dev/null || true)"
  for launch_dir in "${TMPDIR:-/tmp}"/prefkit-launch.*; do
    [[ -O $launch_dir && -f $launch_dir/launcher ]] || continue
    read -r owner owner_start owner_here <"$launch_dir/launcher" || continue
    [[ -z $owner_here || $owner_here == "$here" ]] || continue
    if [[ -n $owner_start && $(process_start "$owner") != "$owner_start" ]]; then
      rm -rf "$launch_dir"
    fi
  done
  PREFKIT_EXIT_DIR=$(mktemp -d "${TMPDIR:-/tmp}/prefkit-launch.XXXXXX")
  export PREFKIT_EXIT_DIR
  # Never fails: under `set -e` a failing command in the EXIT trap becomes the script's status (a lost node's 6 read
  # as 1 when a second worker recorded its own stop while the directory was being removed). Once more after a second.
  trap 'rm -rf "$PREFKIT_EXIT_DIR" 2>/dev/null || { sleep 1; rm -rf "$PREFKIT_EXIT_DIR" 2>/dev/null; } || true' EXIT
  if [[ -r /proc/$$/stat ]]; then
    echo "$$ $(process_start $$) $here" >"$PREFKIT_EXIT_DIR/launcher"
  fi
  # One process first checks the configuration and the data and tokenizes it into the cache, so a mistake is one
  # line (not one per rank under torchrun's failure report) and the workers start on prepared data. A run the same
  # command already finished is finished there (its report, index, model card, hold) and nothing else starts.
  WORLD_SIZE=$((NUM_PROCS * NNODES)) LOCAL_WORLD_SIZE=$NUM_PROCS RANK=$((NODE_RANK * NUM_PROCS)) LOCAL_RANK=0 \
    PREFKIT_QUIET_DRY_RUN=$((1 - dry_run)) "$PYTHON" -m src.main_distributed --dry_run "$@" || exit $?
  [[ $dry_run -eq 1 ]] && exit 0  # the check was all that was asked
  [[ -f $PREFKIT_EXIT_DIR/finished ]] && exit 0  # already finished: no worker to start
  # What the preflight found the launch's own processes need (src/library_warnings.py: DS_ACCELERATOR=cpu where no GPU
  # driver is, so that accelerate launch's DeepSpeed import does not warn that it guessed).
  if [[ -f $PREFKIT_EXIT_DIR/environment ]]; then
    while IFS= read -r assignment; do export "${assignment?}"; done <"$PREFKIT_EXIT_DIR/environment"
  fi
  export PREFKIT_PREFLIGHT_DONE=1  # the workers do not repeat its notices (an unreachable Hub)
fi

# On CPU, split the cores between the processes (torchrun would otherwise give each process one thread): the cores
# this process may use, a container's CPU quota counted (nproc counts the affinity alone: a 4-CPU pod's 128 cores).
if [[ -z ${OMP_NUM_THREADS:-} ]]; then
  OMP_NUM_THREADS=$("$PYTHON" -m src.resource_limits "$NUM_PROCS" 2>/dev/null || echo 1)
  export OMP_NUM_THREADS
fi

if [[ -z ${MASTER_PORT:-} ]]; then
  if [[ $NNODES -eq 1 ]]; then  # one node: any free port, so several jobs can share a machine
    MASTER_PORT=$("$PYTHON" -c "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])")
  else
    MASTER_PORT=29500
  fi
fi
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
# gloo (CPU training, and the CPU-side collectives of a GPU job) binds to the address this machine's hostname
# resolves to: often 127.0.0.1, or one of several NICs that the other nodes cannot reach. With several nodes, bind it
# to the interface this node reaches MASTER_ADDR through (the one holding it, on the master node). Set
# GLOO_SOCKET_IFNAME yourself to choose another; NCCL picks its own (NCCL_SOCKET_IFNAME overrides it).
if [[ $NNODES -gt 1 && -z ${GLOO_SOCKET_IFNAME:-} ]] && command -v ip >/dev/null; then
  master_ip=$(getent ahostsv4 "$MASTER_ADDR" 2>/dev/null | awk '{print $1; exit}' || true)  # unresolvable: as given
  master_ip=${master_ip:-$MASTER_ADDR}
  interface=$(ip -o addr show to "$master_ip" 2>/dev/null | awk '{print $2; exit}' || true)
  if [[ -z $interface ]]; then
    interface=$(ip -o route get "$master_ip" 2>/dev/null |
                awk '{for (i = 1; i < NF; i++) if ($i == "dev") {print $(i + 1); exit}}' || true)
  fi
  if [[ -n $interface ]]; then
    export GLOO_SOCKET_IFNAME=$interface
    echo "run_distributed.sh: node $NODE_RANK reaches MASTER_ADDR $MASTER_ADDR through $interface" \
         "(GLOO_SOCKET_IFNAME)" >&2
  fi
fi
if [[ $STRATEGY == torchrun ]]; then
  # torchrun (python -m torch.distributed.run is the same launcher, with this interpreter). Static rendezvous, also
  # on one node: torchrun's c10d rendezvous (what --standalone uses) is what restarted jobs hung on here.
  launch=("$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --node_rank "$NODE_RANK"
          --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" --nproc_per_node "$NUM_PROCS"
          --max-restarts "${MAX_RESTARTS:-3}" -m src.main_distributed "$@")
else
  launch=("$PYTHON" -m accelerate.commands.launch --config_file "configs/accelerate/$STRATEGY.yaml"
          --num_processes $((NUM_PROCS * NNODES)) --num_machines "$NNODES" --machine_rank "$NODE_RANK"
          --main_process_ip "$MASTER_ADDR" --main_process_port "$MASTER_PORT"
          --max_restarts "${MAX_RESTARTS:-3}" src/main_distributed.py "$@")
fi
if [[ ${PRINT_LAUNCH:-0} == 1 ]]; then
  printf '%q ' "${launch[@]}"
  echo
  exit 0
fi
# Bound to this script (src/run_safety/parent_watch.py): a kill -9 of it alone still stops the launch (SIGTERM).
"$PYTHON" -m src.run_safety.parent_watch "${launch[@]}" <&0 &
launcher=$!
trap 'kill -TERM "$launcher" 2>/dev/null || true' TERM HUP  # a scheduler's stop: torchrun stops its workers
trap ':' INT  # Ctrl-C reaches torchrun and its workers themselves; wait for them to save and exit
# A worker that ends the job itself (a lost node, a hang, an error no restart cures: src/run_safety/launcher_exit.py)
# SIGKILLs torchrun's agent after recording the job's status, which this script reports below: bash's own "Killed"
# notice of the agent (printed by `wait`) would only add a line that says nothing.
while kill -0 "$launcher" 2>/dev/null; do
  wait "$launcher" 2>/dev/null || true
done
status=0
wait "$launcher" 2>/dev/null || status=$?
for recorded in "$PREFKIT_EXIT_DIR"/rank-*; do
  [[ -f $recorded ]] && status=$(<"$recorded") && break
done
exit "$status"
