# One call of the 2026-11-28 (third) session on nvidia-h200-x4: the real-model run (dense and v1024s6144, seeds 0-2
# on GPUs 0-2) with a side job on GPU 3, chosen by what the machine holds: first the single-GPU kernel rate sweep at
# 512K, then (once the model is converted) bench/eval_prefill.py on the real model, base and trained.
source tools/device_env.sh || exit 2
export MTRAINING_COMMIT=${MTRAINING_COMMIT:?}
SIDE=/root/side; mkdir -p $SIDE $OUT/side
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpus.txt
side() {
  if [ ! -f $SIDE/rate ]; then
    touch $SIDE/rate
    CUDA_VISIBLE_DEVICES=3 timeout 240 python3 bench/sparse_attention.py --seq-lens 524288 --inputs structured \
      --sweep 0.03 0.1 0.3 --sweep-lens 524288 --out $OUT/side/sparse_attention_rate_512k_h200_$MTRAINING_COMMIT.json \
      > $OUT/side/sparse_attention_512k.log 2>&1; echo "bench rc $?" >> $OUT/side/sparse_attention_512k.log
  elif [ -f /root/rx/model/config.json ] && [ ! -f $SIDE/prefill ]; then
    touch $SIDE/prefill
    CUDA_VISIBLE_DEVICES=3 timeout 300 python3 bench/eval_prefill.py --model /root/rx/model --lengths 32768 65536 \
      --repeats 2 --profile --out $OUT/side/eval_prefill_base.json > $OUT/side/eval_prefill_base.log 2>&1
    echo "rc $?" >> $OUT/side/eval_prefill_base.log
  else
    trained=$(ls -d /root/rx/gpu*/runs/*/export 2>/dev/null | head -1)
    if [ -n "$trained" ] && [ ! -f $SIDE/prefill_trained ]; then
      touch $SIDE/prefill_trained; echo "$trained" > $OUT/side/eval_prefill_trained.model
      CUDA_VISIBLE_DEVICES=3 timeout 200 python3 bench/eval_prefill.py --model "$trained" --lengths 65536 \
        --repeats 2 --out $OUT/side/eval_prefill_trained.json > $OUT/side/eval_prefill_trained.log 2>&1
      echo "rc $?" >> $OUT/side/eval_prefill_trained.log
    fi
  fi
}
side &
bash experiments/real_extension/gpu_call.sh "$@" > $OUT/call.log 2>&1; rc=$?
wait
tail -4 $OUT/side/*.log 2>/dev/null; tail -25 $OUT/call.log
exit $rc
