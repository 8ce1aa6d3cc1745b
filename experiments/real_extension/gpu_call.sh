#!/usr/bin/env bash
# One device call of the real-model experiment, the same every call and re-issued while it exits 3 (--plan prints
# the calls). Call 1 carries .gguf/smollm2.gguf.part00 (stashed in /root/gguf) and builds the corpus with
# .gguf/tok; call 2 carries part01: the halves are joined, checked against .gguf/SHA256, and the run goes on.
# Every call carries .whl, .gguf/tok and the prose archive; results land in $OUT/results*.tgz after every stage.
# Usage: MTRAINING_COMMIT=<commit> bash experiments/real_extension/gpu_call.sh <driver options>
source "$(dirname "$0")/../../tools/device_env.sh"
export MTRAINING_COMMIT
G=/root/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p /root/gguf
[ -f .gguf/smollm2.gguf.part00 ] && cp .gguf/smollm2.gguf.part00 .gguf/SHA256 /root/gguf/
if [ ! -s $G ] && [ -f .gguf/smollm2.gguf.part01 ]; then
  { cat /root/gguf/smollm2.gguf.part00 .gguf/smollm2.gguf.part01 > /root/gguf/joined && mv /root/gguf/joined $G \
    && (cd /root/gguf && sha256sum -c SHA256); } || { rm -f $G; echo "the GGUF does not join: carry part00 first"; exit 2; }
fi
python3 -m experiments.real_extension --gguf $G --tokenizer .gguf/tok --work /root/rx --out /root/rx/out \
  --tar "$OUT/results.tgz" "$@"
rc=$?; echo "EXIT $rc"; exit $rc
