#!/usr/bin/env bash
# One device call of the real-model experiment, the same every call and re-issued while it exits 3 (--plan prints
# the calls). The GGUF travels in parts, one per call (a call carries at most 64 MiB with the working tree):
# .gguf/SHA256 names every part and the whole file; each carried part is stashed in /root/gguf, checked, and once
# every part has come they are joined, the whole checked, and the run goes on. Call 1 also builds the corpus with
# .gguf/tok. Every call carries .gguf/tok, .gguf/SHA256 and the prose archive, the first also .whl; results land in
# $OUT/results*.tgz after every stage. FlashAttention-4's wheels (for --speed-backends fa4) travel the same way in
# `.fa4/` when carried (tools/fa4_wheels.sh).
# Usage: MTRAINING_COMMIT=<commit> bash experiments/real_extension/gpu_call.sh <driver options>
source "$(dirname "$0")/../../tools/device_env.sh"
source "$(dirname "$0")/../../tools/fa4_wheels.sh"
export MTRAINING_COMMIT
STASH=/root/gguf
G=$STASH/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p $STASH
cp .gguf/SHA256 $STASH/
for part in .gguf/smollm2.gguf.part*; do
  [ -f "$part" ] || continue
  cp "$part" $STASH/ && (cd $STASH && grep " $(basename "$part")\$" SHA256 | sha256sum -c --quiet) \
    || { echo "$part does not match .gguf/SHA256"; exit 2; }
done
if [ ! -s $G ]; then
  parts=$(grep -o 'smollm2\.gguf\.part[0-9]*$' $STASH/SHA256)
  missing=$(for p in $parts; do [ -f $STASH/$p ] || echo $p; done)
  if [ -z "$missing" ]; then
    { (cd $STASH && cat $parts > joined) && mv $STASH/joined $G \
      && (cd $STASH && grep " $(basename $G)\$" SHA256 | sha256sum -c --quiet); } \
      || { rm -f $G; echo "the GGUF parts do not join to the file .gguf/SHA256 names"; exit 2; }
  else
    echo "GGUF parts still to carry:" $missing  # one line
  fi
fi
python3 -m experiments.real_extension --gguf $G --tokenizer .gguf/tok --work /root/rx --out /root/rx/out \
  --tar "$OUT/results.tgz" "$@"
rc=$?; echo "EXIT $rc"; exit $rc
