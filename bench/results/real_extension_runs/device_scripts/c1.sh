# Call 1 of the 2-GPU machine: stash half of the GGUF; prebuild the real corpus (CPU); a GPU smoke of the
# real-model experiment (random 2-layer SmolLM2 shape, 16K) on GPU 0 beside the non-finite-masking kernels A/B on
# GPU 1; then ring vs all-gather on both GPUs (issue 32 item 5). Everything lands in /root/c1, packed into $OUT/c1.tgz.
source .gpu_scripts/env.sh
C=/root/c1; mkdir -p /root/gguf /root/smoke $C && cp .gguf/smollm2.gguf.part00 .gguf/SHA256 /root/gguf/
nvidia-smi -L; python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
(timeout 420 python3 -m mtraining.cli corpus /root/corpus.part --tokenizer .gguf/tok --python /opt/torch/.venv/bin/python3 \
   --prose .gguf/python-3.11-docs.tar.xz --heldout prose/howto --heldout-fraction 0.15 --heldout-min-tokens 65536 --workers 24 \
   && mv /root/corpus.part /root/corpus; echo CORPUS $?) > $C/corpus.log 2>&1 &
(python3 -c "from transformers import AutoConfig as C, AutoModelForCausalLM as M, AutoTokenizer as T; c=C.from_pretrained('.gguf/tok'); c.num_hidden_layers=2; M.from_config(c).save_pretrained('/root/smoke/model'); T.from_pretrained('.gguf/tok').save_pretrained('/root/smoke/model')" \
 && CUDA_VISIBLE_DEVICES=0 timeout 230 python3 -m experiments.real_extension --work /root/smoke --code $PWD/exp/nan_after \
   --prose .gguf/python-3.11-docs.tar.xz --length 16384 --seeds 0 --steps 2 --niah-prompts 2 --ruler-samples 1 --ppl-windows 1 \
   --base-prompts 2 --base-gate 0 --no-base-read --speed-lengths 16384 --speed-layers 0 1 --workers 8 --out $C/smoke --max-minutes 3.6; echo SMOKE $?) > $C/smoke.log 2>&1 &
SP=$!
CUDA_VISIBLE_DEVICES=1 DEADLINE=235 bash .gpu_scripts/side_kernels.sh > $C/kv.log 2>&1 &
KP=$!
wait $SP $KP
tail -30 $C/smoke.log
timeout $((470 - SECONDS)) python3 -m torch.distributed.run --standalone --nproc_per_node 2 bench/ring_attention.py --seq-lens 131072 262144 524288 \
  --methods torch_cp dense_zigzag sparse_striped --schedules flat allgather --iters 3 --out $C/ring_2gpu.json > $C/ring.log 2>&1; echo RING $? >> $C/ring.log
wait
for f in $C/*.log; do echo "== $f"; tail -6 $f; done
ls -l /root/gguf; ls /root/corpus 2>&1 | head -3; (cd /root && tar czf $OUT/c1.tgz c1)
