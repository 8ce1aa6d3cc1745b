"""Compile every Triton kernel for an H100/H200 (sm_90) without a GPU: catches compile errors on the CPU.

Run as a script in a process without TRITON_INTERPRET (tests/test_kernels_compile.py does).
"""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget

from mtraining.ops.sparse import index_kernels as wk
from mtraining.ops.sparse import kernels as tk
from mtraining.train import ce_kernel

INT_POINTERS = {
    "QPos",
    "KPos",
    "QGBlock",
    "Starts",
    "Count",
    "DiagStart",
    "VCols",
    "VCountQ",
    "VStartRow",
    # index builders (walk_kernels.py)
    "BlockDiags",
    "NumDiags",
    "VertPos",
    "NumVerts",
    "QStart",
    "KStart",
    "VColPos",
    "OtherStart",
    "GBlock",
    "Diag",
    "Extra",
}
FP32_POINTERS = {"Lse", "Delta", "DQ", "DK", "DV"}
DATA_POINTERS = {"Q", "K", "V", "Out", "DO"}
FLOAT_SCALARS = {"qk_scale", "sm_scale"}
DESCRIPTORS = {"KDesc", "VDesc"}


def signature(fn, constexprs: dict) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in INT_POINTERS:
            sig[name] = "*i32"
        elif name == "DiagMask":
            sig[name] = "*i8"
        elif name in FP32_POINTERS:
            sig[name] = "*fp32"
        elif name in DATA_POINTERS:
            sig[name] = "*bf16"
        elif name in DESCRIPTORS:  # key/value tiles of one head (triton_backend._key_tiles)
            sig[name] = f"tensordesc<bf16[1,{constexprs['BLOCK_N']},1,{constexprs['HEAD_DIM']}]>"
        elif name in FLOAT_SCALARS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def main() -> None:
    target = GPUTarget("cuda", 90, 32)
    tiles = dict(G=128, HEAD_DIM=128)
    for fn, extra in [
        (tk._fwd_kernel, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_V=64, MERGE=False)),
        (tk._fwd_kernel, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_V=64, MERGE=True)),
        (tk._bwd_dq_kernel, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_V=64)),
        (tk._bwd_dkdv_block_kernel, dict(BLOCK_M=64, BLOCK_N=64, DQ_MODE=0)),
        (tk._bwd_dkdv_block_kernel, dict(BLOCK_M=64, BLOCK_N=128, DQ_MODE=1)),
        (tk._bwd_dkdv_vertical_kernel, dict(BLOCK_M=64, BLOCK_V=64, DQ_MODE=0)),
        (tk._bwd_dkdv_vertical_kernel, dict(BLOCK_M=64, BLOCK_V=64, DQ_MODE=1)),
    ]:
        compile_one(fn, {**tiles, **extra}, target, dict(num_warps=8, num_stages=3))
    # the index builders launch with Triton's defaults
    blocks = wk.BLOCKS
    for fn, extra in [
        (wk._pair_kernel, dict(BLOCK_NB=blocks["nb"], BLOCK_V=blocks["verts"])),
        (wk._walk_kernel, dict(QUERY=True, BLOCK_R=blocks["rows"], BLOCK_D=blocks["diags"])),
        (wk._walk_kernel, dict(QUERY=False, BLOCK_R=blocks["rows"], BLOCK_D=blocks["diags"])),
    ]:
        compile_one(fn, dict(G=128, **extra), target, dict(num_warps=4, num_stages=3))
    # the loss's rows kernel: float32 logits, bf16 gradient
    ce_signature = {
        "logits_ptr": "*fp32",
        "labels_ptr": "*i64",
        "loss_ptr": "*fp32",
        "grad_ptr": "*bf16",
        "vocab": "i32",
        "logits_stride": "i64",
        "grad_stride": "i64",
        "ignore_index": "i64",
        "BLOCK": "constexpr",
        "WRITE_GRAD": "constexpr",
    }
    src = triton.compiler.ASTSource(
        fn=ce_kernel._cross_entropy_rows_kernel, signature=ce_signature, constexprs=dict(BLOCK=4096, WRITE_GRAD=True)
    )
    triton.compile(src, target=target, options=dict(num_warps=8))
    print("_cross_entropy_rows_kernel: ok")


def compile_one(fn, constexprs: dict, target, options: dict) -> None:
    src = triton.compiler.ASTSource(fn=fn, signature=signature(fn, constexprs), constexprs=constexprs)
    compiled = triton.compile(src, target=target, options=options)
    print(f"{fn.__name__}: ok, {compiled.metadata.shared} bytes shared memory")


if __name__ == "__main__":
    main()
