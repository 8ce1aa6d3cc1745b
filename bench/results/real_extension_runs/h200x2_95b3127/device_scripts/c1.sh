# Call 1 of the 2026-11-28 (second) session on nvidia-h200-x2: the real-model run's corpus (CPU) while GPU 0
# runs the CUDA test module and GPU 1 the single-GPU kernel rate sweep (over_ideal) at 128K and 512K.
source tools/device_env.sh || exit 2
export MTRAINING_COMMIT=${MTRAINING_COMMIT:?}
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpus.txt
(CUDA_VISIBLE_DEVICES=0 timeout 230 python3 -m pytest -q -m cuda tests/ops/test_kernels_cuda.py -x > $OUT/cuda_tests.log 2>&1; echo "pytest rc $?" >> $OUT/cuda_tests.log) &
(CUDA_VISIBLE_DEVICES=1 timeout 230 python3 bench/sparse_attention.py --seq-lens 131072 --inputs structured --sweep 0.03 0.1 0.3 --sweep-lens 131072 524288 --out $OUT/sparse_attention_h200_$MTRAINING_COMMIT.json > $OUT/sparse_attention.log 2>&1; echo "bench rc $?" >> $OUT/sparse_attention.log) &
bash experiments/real_extension/gpu_call.sh "$@" > $OUT/call.log 2>&1; rc=$?
wait
tail -5 $OUT/cuda_tests.log $OUT/sparse_attention.log; tail -20 $OUT/call.log
exit $rc
