"""Compile every Triton kernel for an H100/H200 (sm_90) without a GPU: catches compile errors on the CPU.

Run as a script in a process without TRITON_INTERPRET (tests/ops/test_kernels_compile.py does).
``--ptx-dir DIR`` also writes each kernel's PTX to DIR/<label>.ptx, one file per compiled
configuration, for tools/ptx_compare.py (the PTX of two commits, compared without a GPU).
The column scorer compiles as launched at G = 128, D = 64, with and without documents; the sorted column
scorer at G = 128, D = 64 and 128, with its smallest and largest row tiles.
The attention kernels compile with the bf16 tiles of ``launch.tile_config`` at G = 128, D = 128, each
without packed documents (their arguments constexpr None, as launched without documents) and the
forward, dQ, dK/dV and walk kernels also with them (labels ``*_docs``); a kernel without a DOCS
argument (an older commit's) compiles without documents only. Likewise per-block columns: the forward and
dQ kernels compile without them (COLUMNS False, their arguments constexpr None) and with them
(``*_columns``), and the column dK/dV kernel, where the commit has them. NamedTuple arguments (a tensor with
its strides, a walk) get their signature from the kernel's annotations, their fields typed by name (``FIELD_TYPES``).
``--divisible-walk-strides`` compiles the attention kernels as Triton specialises them at run time when the
walks' strides are multiples of 16 (every int inside a tuple argument is specialised), for tools/ptx_compare.py
to compare with the plain dump.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import typing
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

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
    # index builders (ops/sparse/index_kernels.py)
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
    # packed documents
    "QBound",
    "Unmasked",
    "VFirst",
    "VEndRow",
    "DocExtra",
    # per-block columns
    "ColRows",
    "ColCount",
    # column scorer (ops/estimate/column_kernels.py)
    "QCodes",
    "KCodes",
    # sorted column scorer (ops/estimate/column_bucket_kernels.py)
    "RowOrder",
    "TileStart",
    "RowCodes",
    "Lo",
    "Hi",
    "First",
    "KeyOrder",
    "KeyCodes",
}
# The arguments of the document path: constexpr None when a kernel runs without documents (an argument,
# or a field of a NamedTuple argument: the walks' document lists).
DOCUMENT_ARGS = (
    "QBound",
    "Unmasked",
    "VFirst",
    "VEndRow",
    "DocExtra",
    "stride_bb",
    ("Walk", "unmasked"),
    ("Walk", "vfirst"),
    ("Walk", "vend"),
    ("Out", "unmasked"),  # the walk builders' lists
    ("Out", "doc_extra"),
)
# The arguments of the per-block columns in the forward and dQ kernels: constexpr None without them.
COLUMN_ARGS = ("ColRows", "ColCount", "stride_xb", "stride_xh", "stride_xt", "Columns")
# Fields of NamedTuple arguments (ops/sparse/kernels.py, index.py), by name: pointers to bf16 data, to float32
# statistics and gradients, to int8 masks; every other field named stride_* is an int, the rest int32 lists.
FIELD_TYPES = {"ptr": "*bf16", "lse": "*fp32", "delta": "*fp32", "dk": "*fp32", "dv": "*fp32", "diag_mask": "*i8"}
FP32_POINTERS = {"Lse", "Delta", "DQ", "DK", "DV", "Score"}
BYTE_MASKS = {"DiagMask", "VMask"}
DATA_POINTERS = {"Q", "K", "V", "Out", "DO"}  # also the ptr of a HeadTensor argument of that name
FLOAT_SCALARS = {"qk_scale", "sm_scale"}
DESCRIPTORS = {"KDesc", "VDesc"}
# Every launch configuration: (label, kernel, constexprs beyond G and HEAD_DIM, num_warps, num_stages).
ATTENTION = [
    (
        "fwd",
        "_fwd_kernel",
        {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_V": 64, "MERGE": False, ("Stats", "delta"): None},
        8,
        3,
    ),
    (
        "fwd_merge",
        "_fwd_kernel",
        {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_V": 64, "MERGE": True, ("Stats", "delta"): None},
        8,
        3,
    ),
    ("dq", "_bwd_dq_kernel", dict(BLOCK_M=64, BLOCK_N=64, BLOCK_V=64), 4, 2),
    ("dkdv_block", "_bwd_dkdv_block_kernel", dict(BLOCK_M=64, BLOCK_N=64, DQ_MODE=0), 4, 2),
    ("dkdv_block_dq", "_bwd_dkdv_block_kernel", dict(BLOCK_M=64, BLOCK_N=128, DQ_MODE=1), 4, 2),
    ("dkdv_vertical", "_bwd_dkdv_vertical_kernel", dict(BLOCK_M=64, BLOCK_V=64, DQ_MODE=0), 4, 2),
    ("dkdv_vertical_dq", "_bwd_dkdv_vertical_kernel", dict(BLOCK_M=64, BLOCK_V=64, DQ_MODE=1), 4, 2),
    ("dkdv_column", "_bwd_dkdv_column_kernel", dict(BLOCK_M=64, BLOCK_V=64, DQ_MODE=0), 4, 2),
]
DOCUMENTS = ("fwd", "dq", "dkdv_block", "dkdv_vertical", "dkdv_column")  # also compiled with packed documents
COLUMNS = ("fwd", "dq")  # also compiled with per-block columns
# The row-delta kernel and the index builders launch with Triton's defaults (4 warps, 3 stages).
ROW_DELTA = ("row_delta", "_row_delta_kernel", dict(BLOCK_R=64, HEAD_DIM=128))
BUILDERS = [
    ("pair", "_pair_kernel", lambda b: dict(BLOCK_NB=b["nb"], BLOCK_V=b["verts"])),
    ("query_walk", "_walk_kernel", lambda b: dict(QUERY=True, BLOCK_R=b["rows"], BLOCK_D=b["diags"])),
    ("key_walk", "_walk_kernel", lambda b: dict(QUERY=False, BLOCK_R=b["rows"], BLOCK_D=b["diags"])),
]
# The column scorer as select_block_columns launches it at G = 128, D = 64 (8 tables), 4 warps.
SCORER = (
    "column_scores",
    "_column_score_kernel",
    {
        "G": 128,
        "HEAD_DIM": 64,
        "BLOCK_N": 64,
        "TABLES": 8,
        ("Stats", "delta"): None,  # the LSE alone
        ("VMask", "stride_x"): None,  # [B, H, N] masks
        ("DiagMask", "stride_x"): None,
    },
)
# The sorted column scorer as its launcher picks its tiles (8 tables, 4 warps).
SORTED_SCORER = [
    (
        f"bucket_scores_d{d}_m{m}",
        "_bucket_score_kernel",
        {
            "G": 128,
            "HEAD_DIM": d,
            "BLOCK_M": m,
            "BLOCK_N": 64,
            "T": 8,
            ("Stats", "delta"): None,
            ("VMask", "stride_x"): None,
            ("DiagMask", "stride_x"): None,
        },
    )
    for d in (64, 128)
    for m in (16, 64)
]


def _jit(fn):
    """The JITFunction under a kernel's @triton.heuristics."""
    while isinstance(fn, triton.runtime.Heuristics):
        fn = fn.fn
    return fn


def _tuple_arguments(fn) -> dict:
    """The kernel's NamedTuple arguments (by their annotations): name -> NamedTuple class."""
    hints = typing.get_type_hints(fn.fn)
    return {
        name: t for name, t in hints.items() if isinstance(t, type) and issubclass(t, tuple) and hasattr(t, "_fields")
    }


def _modules():
    """(attention kernels, index builders); the modules before issue 17's ops/sparse/ folder also load,
    so that the PTX of an older commit can be dumped for comparison (PYTHONPATH=<its worktree>)."""
    try:
        return importlib.import_module("mtraining.ops.sparse.kernels"), importlib.import_module(
            "mtraining.ops.sparse.index_kernels"
        )
    except ModuleNotFoundError:
        return importlib.import_module("mtraining.ops.triton_kernels"), importlib.import_module(
            "mtraining.ops.walk_kernels"
        )


def _scorer_module(name: str = "column_kernels"):
    """A column scorer's kernel module (in ops/pattern/ before the estimator moved to ops/estimate/), None in a
    commit before it."""
    for package in ("mtraining.ops.estimate", "mtraining.ops.pattern"):
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError:
            continue
    return None


def _source() -> dict:
    """Which mtraining (path, git commit) and Triton the dump was compiled from."""
    import mtraining

    package = Path(mtraining.__file__).resolve().parent
    git = ["git", "-C", str(package)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "diff", "--quiet", "HEAD", "--", "."], capture_output=True).returncode != 0
    return dict(mtraining=str(package), commit=head + ("+dirty" if dirty else ""), triton=triton.__version__)


def signature(fn, constexprs: dict) -> tuple[dict, dict]:
    """(signature, constexprs) of ``fn`` for ASTSource: ``constexprs`` keyed by argument name or by (NamedTuple
    argument, field) become Triton's constexprs keyed by name or by (argument index, field index)."""
    tuples = _tuple_arguments(fn)
    sig, consts = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            consts[name] = constexprs[name]
        elif name in tuples:
            fields = []
            for j, field in enumerate(tuples[name]._fields):
                if (name, field) in constexprs:
                    fields.append("constexpr")
                    consts[(i, j)] = constexprs[(name, field)]
                elif field == "ptr":  # a tensor and its strides: typed as a plain argument of that name
                    fields.append(_argument_type(name, constexprs))
                else:
                    fields.append("i32" if field.startswith("stride_") else FIELD_TYPES.get(field, "*i32"))
            sig[name] = tuples[name](*fields)
        else:
            sig[name] = _argument_type(name, constexprs)
    return sig, consts


def _argument_type(name: str, constexprs: dict) -> str:
    """The type of a plain (not constexpr, not tuple) argument, by its name."""
    if name in INT_POINTERS:
        return "*i32"
    if name in BYTE_MASKS:
        return "*i8"
    if name in FP32_POINTERS:
        return "*fp32"
    if name in DATA_POINTERS:
        return "*bf16"
    if name in DESCRIPTORS:  # key/value tiles of one head (ops/sparse/launch.py, _key_tiles)
        return f"tensordesc<bf16[1,{constexprs['BLOCK_N']},1,{constexprs['HEAD_DIM']}]>"
    if name in FLOAT_SCALARS:
        return "fp32"
    return "i32"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ptx-dir", type=Path, help="write each kernel's PTX to DIR/<label>.ptx")
    parser.add_argument(
        "--divisible-walk-strides",
        action="store_true",
        help="compile as if every stride of a walk argument were a multiple of 16 (how Triton specialises them)",
    )
    args = parser.parse_args()
    if args.ptx_dir:
        args.ptx_dir.mkdir(parents=True, exist_ok=True)
        (args.ptx_dir / "source.json").write_text(json.dumps(_source(), indent=1) + "\n")
    target = GPUTarget("cuda", 90, 32)
    kernels, builders = _modules()
    for label, name, extra, warps, stages in ATTENTION:
        fn = getattr(kernels, name, None)
        if fn is None:  # an older commit's kernels
            continue
        fn = _jit(fn)
        for docs in (False, True) if label in DOCUMENTS else (False,):
            for cols in (False, True) if label in COLUMNS else (False,):
                constexprs = optional_path(fn, {"G": 128, "HEAD_DIM": 128, **extra}, "DOCS", DOCUMENT_ARGS, docs)
                constexprs = constexprs and optional_path(fn, constexprs, "COLUMNS", COLUMN_ARGS, cols)
                if constexprs is not None:
                    options = dict(num_warps=warps, num_stages=stages)
                    compile_one(
                        label + "_docs" * docs + "_columns" * cols,
                        fn,
                        constexprs,
                        target,
                        options,
                        args.ptx_dir,
                        args.divisible_walk_strides,
                    )
    label, name, constexprs = ROW_DELTA
    compile_one(label, getattr(kernels, name), constexprs, target, dict(num_warps=4, num_stages=3), args.ptx_dir)
    for label, name, extra in BUILDERS:
        fn = _jit(getattr(builders, name))
        for docs in (False, True) if label != "pair" else (False,):
            constexprs = optional_path(fn, dict(G=128, **extra(builders.BLOCKS)), "DOCS", DOCUMENT_ARGS, docs)
            if constexprs is not None:
                options = dict(num_warps=4, num_stages=3)
                compile_one(label + "_docs" * docs, fn, constexprs, target, options, args.ptx_dir)
    scorer = _scorer_module()
    if scorer is not None:
        label, name, constexprs = SCORER
        fn = _jit(getattr(scorer, name))
        for docs in (False, True):
            options = dict(num_warps=4, num_stages=3)
            constexprs_docs = optional_path(fn, constexprs, "DOCS", DOCUMENT_ARGS, docs)
            compile_one(label + "_docs" * docs, fn, constexprs_docs, target, options, args.ptx_dir)
    bucket_scorer = _scorer_module("column_bucket_kernels")
    if bucket_scorer is not None:
        for label, name, constexprs in SORTED_SCORER:
            options = dict(num_warps=4, num_stages=3)
            compile_one(label, _jit(getattr(bucket_scorer, name)), constexprs, target, options, args.ptx_dir)
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
    compiled = triton.compile(src, target=target, options=dict(num_warps=8))
    _report("cross_entropy_rows", compiled, args.ptx_dir)


def optional_path(fn, constexprs: dict, flag: str, args: tuple, on: bool) -> dict | None:
    """The constexprs of ``fn`` with its optional path ``flag`` (DOCS: packed documents, COLUMNS: per-block
    columns) on, or off with the path's ``args`` None; None where the kernel has no such path (an older
    commit's) and ``on`` asks for it."""
    if flag not in fn.arg_names:
        return None if on else constexprs
    if on:
        return {**constexprs, flag: True}
    tuples = _tuple_arguments(fn)
    present = [
        a
        for a in args
        if (a[0] in tuples and a[1] in tuples[a[0]]._fields if isinstance(a, tuple) else a in fn.arg_names)
    ]
    return {**constexprs, flag: False, **{a: None for a in present}}


def compile_one(
    label: str, fn, constexprs: dict, target, options: dict, ptx_dir: Path | None, divisible_walks: bool = False
) -> None:
    sig, consts = signature(fn, constexprs)
    attrs = {}
    if divisible_walks:  # Triton specialises the ints inside a tuple argument: a stride divisible by 16 is marked so
        for i, name in enumerate(fn.arg_names):
            kind = sig[name]
            if isinstance(kind, tuple) and type(kind).__name__.endswith("Walk"):
                attrs.update(
                    {(i, j): [["tt.divisibility", 16]] for j, f in enumerate(kind._fields) if kind[j] == "i32"}
                )
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    _report(label, triton.compile(src, target=target, options=options), ptx_dir)


def _report(label: str, compiled, ptx_dir: Path | None) -> None:
    print(f"{label} ({compiled.metadata.name}): ok, {compiled.metadata.shared} bytes shared memory")
    if ptx_dir:
        (ptx_dir / f"{label}.ptx").write_text(compiled.asm["ptx"])


if __name__ == "__main__":
    main()
