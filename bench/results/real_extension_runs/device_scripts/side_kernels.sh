# One GPU: the non-finite-masking kernels A/B (issue 34 family 1), then the CUDA kernel tests until $DEADLINE s.
C=${C:-/root/c1}; mkdir -p $C
(cd exp/nan_before && timeout 110 python3 bench/kernel_variants.py --variant nan_before --description "kernels of f442821" --out $C/kernel_variants_nonfinite.json; echo KV_BEFORE $?)
(cd exp/nan_after && timeout 110 python3 bench/kernel_variants.py --variant nan_after --description "non-finite keys behind the mask, 672db7a" --out $C/kernel_variants_nonfinite.json; echo KV_AFTER $?)
left=$(( ${DEADLINE:-235} - SECONDS )); [ $left -gt 20 ] && timeout $left python3 -m pytest -q -m cuda tests/ops/test_kernels_cuda.py -p no:cacheprovider 2>&1 | tail -6
