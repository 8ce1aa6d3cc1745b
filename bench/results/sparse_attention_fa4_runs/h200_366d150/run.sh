# One device call of the FA4 check (issue 32): stash the carried wheels under /root/fa4; once every file SHA256 names
# has come, join the split wheel, check, install into /tmp/site, then the cuda tests and the benchmark. Exit 3: more
# files to carry.
S=/root/fa4; mkdir -p $S; cp .fa4/*.whl* .fa4/SHA256 $S/ 2>/dev/null
W=nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
missing=$(cd $S && awk '{print $2}' SHA256 | while read f; do [ "$f" = "$W" ] || [ -f "$f" ] || echo "$f"; done)
if [ -n "$missing" ]; then echo "still to carry:" $missing; exit 3; fi
if [ ! -d /tmp/site/flash_attn ]; then
  (cd $S && cat $W.part00 $W.part01 $W.part02 > $W && sha256sum -c --quiet SHA256 \
    && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $(ls *.whl)) \
    || { echo "install failed"; exit 2; }
fi
source tools/device_env.sh
export PYTHONPATH=$PYTHONPATH:/tmp/site/nvidia_cutlass_dsl/dsl_packages MTRAINING_COMMIT=${MTRAINING_COMMIT:-unknown}
nvidia-smi -L > $OUT/gpus.txt
python3 -c "import importlib.metadata as m; print({p: m.version(p) for p in ('flash-attn-4','nvidia-cutlass-dsl','quack-kernels','torch','triton')})" | tee $OUT/versions.txt
if [ -z "${ONLY_512K:-}" ]; then
timeout 240 python3 -m pytest -q -m cuda tests/ops/test_fa4.py 2>&1 | tail -40 | tee $OUT/cuda_tests.log
timeout 200 python3 bench/sparse_attention.py --seq-lens 131072 --inputs structured --sweep 0.03 0.1 0.3 --sweep-lens 131072 --backends triton fa4 --out $OUT/sparse_attention_fa4_128k.json 2>&1 | tail -30 | tee $OUT/bench_128k.log
else
timeout 400 python3 bench/sparse_attention.py --seq-lens 524288 --inputs structured --sweep-lens --backends triton fa4 --out $OUT/sparse_attention_fa4_512k.json 2>&1 | tail -30 | tee $OUT/bench_512k.log
fi
echo EXIT 0
