#!/bin/bash
# One H200. (1) The host kept busy (2 spinning processes per core): a 64K evaluation prefill through the sparse
# path (the adaptive setting) with the code before (exp/old = 48b67a2's mtraining, which still did per-layer host
# work in the sparse path, with this commit's bench/eval_prefill.py) and after. (2) The host idle: dense and sparse
# at 64K and 128K with this commit's code, for the real-model experiment's 128K read estimates.
# Random SmolLM2-135M shape (`--random .gguf/tok/config.json`).
PY=/opt/torch/.venv/bin/python3
export PYTHONUNBUFFERED=1
nproc
spin=()
for i in $(seq 1 $((2 * $(nproc)))); do timeout 400 sh -c 'while :; do :; done' & spin+=($!); done
for which in new old; do
  root=$PWD; [ $which = old ] && root=$PWD/exp/old
  timeout 170 $PY $root/bench/eval_prefill.py --random .gguf/tok/config.json --lengths 65536 --arms sparse \
    --repeats 1 --out $OUT/sparse_busy_host_$which.json 2>&1 | grep -v Warn | tail -9
done
kill "${spin[@]}" 2>/dev/null; wait 2>/dev/null
timeout 200 $PY bench/eval_prefill.py --random .gguf/tok/config.json --lengths 65536 131072 --repeats 2 \
  --out $OUT/idle_64k_128k.json 2>&1 | grep -v Warn | tail -16
