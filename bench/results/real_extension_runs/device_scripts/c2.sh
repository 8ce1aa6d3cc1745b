# Calls 2 and 3 (the same command while it exits 3): join the GGUF; two instances of the real-model experiment,
# one per GPU, each with its own work folder and the corpus prebuilt in call 1: GPU 0 seeds 0 and 2, GPU 1 seed 1,
# the speed stage and the base read. Exit: 0 both done, 3 call again.
source .gpu_scripts/env.sh
G=/root/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
[ -s $G ] || { cat /root/gguf/smollm2.gguf.part00 .gguf/smollm2.gguf.part01 > /root/gguf/joined && mv /root/gguf/joined $G \
  && (cd /root/gguf && sha256sum -c SHA256) || { rm -f $G; echo "GGUF not joined"; exit 2; }; }
[ -d /root/corpus ] || { echo "no prebuilt corpus"; exit 2; }
for w in a b; do mkdir -p /root/rx/$w; [ -e /root/rx/$w/corpus ] || cp -al /root/corpus /root/rx/$w/corpus; done
X="python3 -m experiments.real_extension --gguf $G --code-python /opt/torch/.venv/bin/python3 --prose .gguf/python-3.11-docs.tar.xz"
X="$X --base-gate 0 --workers 14 --max-minutes ${MINUTES:-8.6}"
run() { w=$1; shift; (CUDA_VISIBLE_DEVICES=$1 $X --seeds ${@:2} --work /root/rx/$w --out /root/rx/$w/out --tar $OUT/results_$w.tgz > /root/rx/$w.log 2>&1; echo "$w EXIT $?" >> /root/rx/$w.log) & }
run a 0 0 2 --no-speed --no-base-read; run b 1 1
wait
for w in a b; do tail -15 /root/rx/$w.log; done; cat /root/rx/a.log /root/rx/b.log > $OUT/rx.log
codes=$(for w in a b; do tail -1 /root/rx/$w.log | awk '{print $3}'; done | tr '\n' ' '); echo "EXITS $codes"
case " $codes" in *" 3 "*) exit 3;; esac; [ "$codes" = "0 0 " ] && exit 0; exit 1
