# Sourced by bench/sessions/h200x4.sh and h200x8.sh (README.md beside this file): the device environment, the
# lengths, and the phase runner. A call is `bash bench/sessions/h200xN.sh CALL` (or CALL=N in the environment);
# REHEARSE=1 runs the same phases at toy sizes on gloo ranks (CPU). Every phase ends by $DEADLINE seconds into
# the call (the device stops a command at 600 s) and leaves one JSON line in $OUT/calls.jsonl; the output goes
# to $OUT/callN.log too, and each phase's records to $OUT/<phase>.json, rewritten as they come.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2 # the repository root
CALL=${1:-${CALL:-}}
DEADLINE=${DEADLINE:-570}
export PYTHONUNBUFFERED=1
if [ "${REHEARSE:-0}" = 1 ]; then
    OUT=${OUT:-$(mktemp -d)}
    export MTRAINING_COMMIT=${MTRAINING_COMMIT:-$(git rev-parse --short HEAD)}
    DEVICE="cpu (gloo), rehearsal"
    RING_OPTS="--device cpu --heads-q 4 --head-dim 16 --block-size 16 --v-size 16 --s-size 32 --local-window 16"
    RING_OPTS="$RING_OPTS --last-q 16 --iters 1"
    TRAIN_OPTS="--arch tiny --device cpu"
    K128=256 K512=512 M1=1024 M2=2048
    GPU_GB=0
else
    [ -n "${MTRAINING_COMMIT:-}" ] || { echo "set MTRAINING_COMMIT=<git rev-parse --short HEAD, run here>"; exit 2; }
    source tools/device_env.sh || { echo "carry .whl (README.md beside this script)"; exit 2; }
    DEVICE=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
    GPU_GB=$(($(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1) / 1024))
    RING_OPTS=""
    FUSED=none
    python3 -c "import liger_kernel" 2>/dev/null && FUSED=liger # the fused kernels of the 512K rows so far
    TRAIN_OPTS="--fused-kernels $FUSED"
    K128=131072 K512=524288 M1=1048576 M2=2097152
fi
mkdir -p "$OUT"
LOG=$OUT/call$CALL.log
TORCHRUN="python3 -m torch.distributed.run --standalone --nproc_per_node"

# start_call GPUS: check the machine against the call (ranks there, a call number); print what runs where.
start_call() {
    GPUS=$1
    local seen
    seen=$([ "${REHEARSE:-0}" = 1 ] && echo "$GPUS" || nvidia-smi -L | wc -l)
    if [ "$seen" -lt "$GPUS" ]; then echo "this call needs $GPUS GPUs, the machine has $seen"; exit 2; fi
    echo "call $CALL on $GPUS x $DEVICE (${GPU_GB} GB each), commit $MTRAINING_COMMIT, deadline ${DEADLINE}s" | tee -a "$LOG"
}

# phase NAME MIN_S CMD...: run CMD when at least MIN_S seconds are left before the deadline, stopped there
# (TERM, KILL 10 s later) if still running; GB=N before it skips it on GPUs of less memory. One JSON line either way.
phase() {
    local name=$1 min=$2 start=$SECONDS left=$((DEADLINE - SECONDS)) rc=-1 status
    shift 2
    if [ "$left" -lt "$min" ]; then
        status="skipped: ${left}s left, needs ${min}s"
    elif [ "${GB:-0}" -gt 0 ] && [ "$GPU_GB" -gt 0 ] && [ "$GPU_GB" -lt "${GB:-0}" ]; then
        status="skipped: needs ${GB} GB per GPU, these have ${GPU_GB}"
    else
        echo "== $name at ${start}s (${left}s left): $*" | tee -a "$LOG"
        timeout -k 10 "$left" "$@" 2>&1 | tee -a "$LOG"
        rc=${PIPESTATUS[0]}
        case $rc in 0) status=done ;; 124 | 137) status="stopped at the deadline" ;; *) status=failed ;; esac
    fi
    echo "== $name: $status ($((SECONDS - start))s)" | tee -a "$LOG"
    local out=""
    [ -e "$OUT/$name.json" ] && out=$name.json
    python3 -c 'import json, sys; a = dict(zip(sys.argv[1::2], sys.argv[2::2]))
a.update((k, int(a[k])) for k in ("call", "rc", "start_s", "seconds", "gpus")); print(json.dumps(a))' \
        call "$CALL" phase "$name" status "$status" rc "$rc" start_s "$start" seconds "$((SECONDS - start))" \
        device "$DEVICE" gpus "$GPUS" commit "$MTRAINING_COMMIT" out "$out" command "$*" >>"$OUT/calls.jsonl"
}

# ring NAME MIN_S ARGS...: bench/ring_attention.py on every GPU (the cost model's prediction in each record).
ring() {
    local name=$1 min=$2
    shift 2
    # shellcheck disable=SC2086 # RING_OPTS: several words
    phase "$name" "$min" $TORCHRUN "$GPUS" bench/ring_attention.py "$@" $RING_OPTS --out "$OUT/$name.json"
}

# choices NAME: the trainer's parallel.ring: auto beside the measured flat and hierarchical rings of NAME.json.
choices() {
    phase "$1-auto" 5 python3 -m experiments.studies.cost_model --choices "$OUT/$1.json"
}

# train NAME MIN_S ARGS...: bench/train_throughput.py (Qwen2.5-3B shape, structured init), stopped by its own
# time limit after its last whole step, 15 s before the deadline.
train() {
    local name=$1 min=$2
    shift 2
    # shellcheck disable=SC2086 # TRAIN_OPTS: several words
    phase "$name" "$min" python3 bench/train_throughput.py --gpus "$GPUS" "$@" $TRAIN_OPTS \
        --time-limit-s $((DEADLINE - SECONDS - 15)) --out "$OUT/$name.json"
}
