# Issue 36 items 1-3 on 4 GPUs (4 x H200; calls 1-2 and 512K training also on 4 x H100): one call per number,
# `MTRAINING_COMMIT=<commit> bash bench/sessions/h200x4.sh N` with .whl carried (README.md beside this file).
source "$(dirname "$0")/lib.sh"
start_call 4
case $CALL in
1) # item 1: the rings at 128K, 512K and 1M, flat and all-gather (~330 s)
    ring rings 60 --seq-lens $K128 $K512 --methods torch_cp sparse_striped sparse_contiguous dense_zigzag \
        --schedules flat allgather
    ring rings_1m 60 --seq-lens $M1 --methods torch_cp sparse_striped sparse_contiguous dense_zigzag \
        --schedules flat allgather
    ;;
2) # item 2: hierarchical 2 x 2 against flat on NVLink and emulated 25 and 5 GB/s links, the trainer's
    # choice for each case; item 3: training at 512K, dense (~450 s)
    ring hier 60 --seq-lens $K128 $K512 --methods sparse_striped dense_zigzag --schedules flat hierarchical:2 \
        --links host 25 5
    choices hier
    ring hier_1m 40 --seq-lens $M1 --methods sparse_striped --schedules flat hierarchical:2 --links host 25 5
    choices hier_1m
    train train_512k_dense 200 --seq-lens $K512 --modes dense --steps 2 --warmup 1
    ;;
3) # item 3: training at 512K and 1M, sparse; 1M needs ~94 GB per GPU (H200 only) (~500 s)
    train train_512k_sparse 120 --seq-lens $K512 --modes sparse --steps 3 --warmup 1
    GB=100 train train_1m_sparse 200 --seq-lens $M1 --modes sparse --steps 3 --warmup 1
    ;;
4) # item 3: training at 1M, dense (H200 only): one or two steps of ~280 s (~400-570 s)
    GB=100 train train_1m_dense 400 --seq-lens $M1 --modes dense --steps 2 --warmup 1
    ;;
*) echo "CALL must be 1-4 (bench/sessions/README.md)" && exit 2 ;;
esac
