# Issue 37 on 8 GPUs (8 x H200; 2M training needs ~94 GB per GPU): one call per number,
# `MTRAINING_COMMIT=<commit> bash bench/sessions/h200x8.sh N` with .whl carried (README.md beside this file).
source "$(dirname "$0")/lib.sh"
start_call 8
case $CALL in
1) # item 1: the rings at 512K and 1M, flat and all-gather; item 2: hierarchical 2 x 4 against flat on NVLink
    # and emulated 25 and 5 GB/s links (sparse 512K-2M, dense 512K), the trainer's choice for each case (~360 s)
    ring rings 60 --seq-lens $K512 $M1 --methods torch_cp sparse_striped sparse_contiguous dense_zigzag \
        --schedules flat allgather
    ring hier 60 --seq-lens $K512 --methods sparse_striped dense_zigzag --schedules flat hierarchical:4 \
        --links host 25 5
    choices hier
    ring hier_2m 60 --seq-lens $M1 $M2 --methods sparse_striped --schedules flat hierarchical:4 --links host 25 5
    choices hier_2m
    ;;
2) # item 3: training at 1M and 2M, sparse; 2M gets what is left of the call (~490 s)
    train train_1m_sparse 150 --seq-lens $M1 --modes sparse --steps 3 --warmup 1
    GB=100 train train_2m_sparse 200 --seq-lens $M2 --modes sparse --steps 3 --warmup 1
    ;;
3) # item 3: training at 1M, dense: two steps of ~140 s (~370 s)
    train train_1m_dense 250 --seq-lens $M1 --modes dense --steps 2 --warmup 1
    ;;
4) # item 1: the rings at 2M, two timed iterations (~360 s)
    ring rings_2m 60 --seq-lens $M2 --methods torch_cp sparse_striped sparse_contiguous dense_zigzag \
        --schedules flat allgather --iters 2
    ;;
*) echo "CALL must be 1-4 (bench/sessions/README.md)" && exit 2 ;;
esac
