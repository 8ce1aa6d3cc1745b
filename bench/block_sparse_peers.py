"""Block-sparse peers on one GPU: our vertical-slash sparse attention against FlashAttention-4's
block-sparse kernels and FlexAttention, both given our pattern rounded up to G x G blocks, and cuDNN
dense attention, on the same inputs in the same run.

Qwen2.5-3B attention shape by default (16 query heads, 2 KV heads, head_dim 128, bf16, causal),
structured inputs (rope_structured_qkv, seed 0, as bench/sparse_attention.py), pattern estimated
online at the default budgets. Rounding: every G x G block (G = 128 = FA4's sparse block on Hopper
at head_dim 128) that holds a pair of our pattern is computed whole (causally on the diagonal); a
vertical therefore turns on its whole key-block column. FA4 gets those blocks as its block-sparse
tensors with causal=True; FlexAttention gets them as a BlockMask (diagonal blocks partial with a
causal mask_mod, the rest full) and runs compiled. Every method is timed forward and forward +
backward with its pattern or blocks built beforehand; ours also as the training step (estimate +
forward + backward, sparse_total_ms). A correctness check at a small length runs first: ours
against a float32 oracle with the exact pattern, FA4 and Flex against it with the rounded pattern.

    python bench/block_sparse_peers.py --seq-lens 65536 131072 262144
    python bench/block_sparse_peers.py --check-only --device cpu --check-len 512 --block-size 16
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: bench.* modules
from common import add_attention_shape, bench_ms, provenance, write_results  # noqa: E402
from sparse_attention import dense_times, sparse_times, training_step_ms  # noqa: E402

from bench.synthetic import random_qkv, rope_structured_qkv  # noqa: E402
from mtraining.ops import (  # noqa: E402
    PatternConfig,
    VerticalSlashPattern,
    attention_oracle,
    estimate_pattern,
    sparse_attention,  # noqa: E402
)
from mtraining.ops.pattern import compact  # noqa: E402

Attention = Callable[[Tensor, Tensor, Tensor], Tensor]
"""q [B, N, Hq, D], k/v [B, N, Hkv, D] -> out [B, N, Hq, D]."""

CHECK_TOLERANCE = 2e-2  # relative error of bf16 attention against a float32 oracle


# ----------------------------------------------------------------------------- rounding
def vertical_blocks(pattern: VerticalSlashPattern) -> Tensor:
    """Boolean [B, H, num_blocks]: does key block kb hold a vertical of the pattern."""
    if pattern.block_cols is not None:
        raise ValueError(
            "the block-sparse rounding covers verticals and block diagonals only, not per-block columns "
            "(pattern.block_cols): pass the pattern without them"
        )
    g, nb = pattern.block_size, pattern.num_blocks
    verticals = F.pad(pattern.vertical_mask(), (0, nb * g - pattern.seq_len))
    return verticals.view(pattern.batch, pattern.heads, nb, g).any(-1)


def block_mask(pattern: VerticalSlashPattern) -> Tensor:
    """Boolean [B, H, nb, nb]: block (qb, kb) holds a pair of the pattern, i.e. kb <= qb and (block
    diagonal qb - kb is selected or key block kb holds a vertical: a vertical j meets row j itself)."""
    blocks = torch.arange(pattern.num_blocks, device=pattern.device)
    delta = blocks[:, None] - blocks[None, :]
    on_diagonal = pattern.diag_mask()[..., delta.clamp(min=0)]
    return (delta >= 0) & (on_diagonal | vertical_blocks(pattern)[..., None, :])


def rounded_pattern(pattern: VerticalSlashPattern) -> VerticalSlashPattern:
    """The pattern rounded up to its G x G blocks, as a vertical-slash pattern: the same block
    diagonals, and every position of a key block that holds a vertical made a vertical. Its pairs are
    the causal pairs of the blocks ``block_mask`` keeps, so its density() is the rounded density."""
    columns = vertical_blocks(pattern).repeat_interleave(pattern.block_size, -1)[..., : pattern.seq_len]
    return VerticalSlashPattern.from_masks(pattern.diag_mask(), columns, pattern.block_size)


# ----------------------------------------------------------------------------- peers
def causal_mask_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def flex_block_mask(kept: Tensor, seq_len: int, block: int):
    """FlexAttention BlockMask of the kept blocks [B, H, nb, nb]: diagonal blocks partial (causal
    mask_mod), the others full."""
    from torch.nn.attention.flex_attention import BlockMask

    nb = kept.shape[-1]
    blocks = torch.arange(nb, device=kept.device, dtype=torch.int32)
    diagonal = blocks[:, None] == blocks[None, :]
    columns = blocks.expand_as(kept)
    partial_idx, partial_num = compact(columns, kept & diagonal, 0, nb)
    full_idx, full_num = compact(columns, kept & ~diagonal, 0, nb)
    return BlockMask.from_kv_blocks(
        partial_num,
        partial_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=block,
        mask_mod=causal_mask_mod,
        seq_lengths=(seq_len, seq_len),
    )


def flex_attention_fn(mask) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """Compiled FlexAttention with ``mask`` on [B, H, N, D] tensors (GQA)."""
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    return lambda qh, kh, vh: flex(qh, kh, vh, block_mask=mask, enable_gqa=True)


def heads_first(attn: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Attention:
    """Wrap an attention on [B, H, N, D] tensors into one on [B, N, H, D] (for the check only)."""
    return lambda q, k, v: attn(*(t.transpose(1, 2).contiguous() for t in (q, k, v))).transpose(1, 2)


def fa4_status() -> tuple[str | None, str | None]:
    """(installed flash-attn-4 version, None), or (None, why it cannot be imported here)."""
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as e:  # the CuTe DSL raises more than ImportError when its libraries do not load
        return None, f"{type(e).__name__}: {e}"
    return metadata.version("flash-attn-4"), None


def fa4_attention_fn(mask) -> Attention:
    """FA4 block-sparse attention (causal=True) on the BlockMask's blocks: the forward reads its
    kv-direction lists, the backward its q-direction lists, both at the mask's block size."""
    from flash_attn.cute import flash_attn_func
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    size = tuple(mask.BLOCK_SIZE)
    fwd = BlockSparseTensorsTorch(
        mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices, block_size=size
    )
    bwd = BlockSparseTensorsTorch(
        mask.q_num_blocks, mask.q_indices, mask.full_q_num_blocks, mask.full_q_indices, block_size=size
    )
    return lambda q, k, v: flash_attn_func(
        q, k, v, causal=True, block_sparse_tensors=fwd, block_sparse_tensors_bwd=bwd
    )[0]


def ours_fn(pattern: VerticalSlashPattern) -> Attention:
    return lambda q, k, v: sparse_attention(q, k, v, pattern)


# ----------------------------------------------------------------------------- check
def _outputs_and_grads(attn: Attention, q: Tensor, k: Tensor, v: Tensor, do: Tensor) -> list[Tensor]:
    """[out, dq, dk, dv] in float32."""
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    out = attn(qg, kg, vg)
    out.backward(do.to(out.dtype))
    return [out.detach().float(), qg.grad.float(), kg.grad.float(), vg.grad.float()]


def _relative_errors(got: list[Tensor], ref: list[Tensor]) -> dict[str, float]:
    return {name: float((g - r).norm() / r.norm()) for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref)}


def correctness(args, device: str, with_fa4: bool) -> dict:
    """Relative errors of ours (vs the exact pattern) and the peers (vs the rounded one) against a
    float32 oracle at a small length, and how far the two oracles are apart. Gaussian inputs, so
    that the pairs the rounding adds carry weight and a method on the wrong pattern fails."""
    n, g = args.check_len, args.block_size
    q, k, v = random_qkv(1, n, args.heads_q, args.heads_kv, args.head_dim, device=device, seed=1)
    do = torch.randn_like(q)
    config = PatternConfig(v_size=args.check_v_size, s_size=args.check_s_size, block_size=g, local_window=g)
    pattern = estimate_pattern(q, k, config)
    rounded = rounded_pattern(pattern)
    refs = {
        name: _outputs_and_grads(
            lambda q_, k_, v_, p=p: attention_oracle(q_, k_, v_, p)[0], q.float(), k.float(), v.float(), do
        )
        for name, p in (("exact", pattern), ("rounded", rounded))
    }
    mask = flex_block_mask(block_mask(pattern), n, g)
    # (pattern it computes, builder). On a CPU FlexAttention runs eager, which ignores the block
    # lists (it applies only the mask_mod) and has no backward: it is checked on a GPU only.
    methods: dict[str, tuple[str, Callable[[], Attention]]] = {"ours": ("exact", lambda: ours_fn(pattern))}
    if device != "cpu":
        methods["flex"] = ("rounded", lambda: heads_first(flex_attention_fn(mask)))
        if with_fa4:
            methods["fa4"] = ("rounded", lambda: fa4_attention_fn(mask))
    rec = dict(
        kind="check",
        seq_len=n,
        inputs="random",
        check_v_size=args.check_v_size,
        check_s_size=args.check_s_size,
        density=float(pattern.density().mean()),
        rounded_density=float(rounded.density().mean()),
        oracles_apart=_relative_errors(refs["rounded"], refs["exact"]),
        tolerance=CHECK_TOLERANCE,
    )
    print(f"check oracles exact vs rounded pattern: {rec['oracles_apart']}", flush=True)
    for name, (target, make) in methods.items():
        try:
            errors = _relative_errors(_outputs_and_grads(make(), q, k, v, do), refs[target])
        except Exception as e:  # a peer that fails is reported, not allowed to end the run
            rec[f"{name}_error"] = f"{type(e).__name__}: {e}"
            print(f"check {name}: FAILED {rec[f'{name}_error']}", flush=True)
            continue
        rec[f"{name}_vs_{target}"] = errors
        rec[f"{name}_passed"] = max(errors.values()) < CHECK_TOLERANCE
        print(f"check {name} vs {target} pattern: {errors} passed={rec[f'{name}_passed']}", flush=True)
    return rec


# ----------------------------------------------------------------------------- timing
def peer_times(attn: Callable[[Tensor, Tensor, Tensor], Tensor], q: Tensor, k: Tensor, v: Tensor, do: Tensor):
    """Forward (no grad) and forward + backward ms of attn on tensors already in its layout."""
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    with torch.no_grad():
        f = bench_ms(lambda: attn(q, k, v))
    fb = bench_ms(lambda: attn(qg, kg, vg).backward(do))
    return f, fb


def _timed(rec: dict, name: str, run: Callable[[], tuple[float, float]]) -> None:
    """Store name_fwd_ms and name_fwd_bwd_ms, or name_error if the method fails."""
    try:
        rec[f"{name}_fwd_ms"], rec[f"{name}_fwd_bwd_ms"] = run()
    except Exception as e:  # a peer that fails is reported, not allowed to end the run
        rec[f"{name}_error"] = f"{type(e).__name__}: {e}"
        print(f"{rec['seq_len']:>7} {name}: FAILED {rec[f'{name}_error']}", flush=True)
    torch.cuda.empty_cache()


def timing(args, n: int, with_fa4: bool) -> dict:
    """One length: every method on the same inputs and pattern, and the ratios to ours."""
    hq, hkv, d, g = args.heads_q, args.heads_kv, args.head_dim, args.block_size
    q, k, v = rope_structured_qkv(1, n, hq, hkv, d, dtype=torch.bfloat16, device="cuda", seed=0)
    do = torch.randn_like(q)
    config = PatternConfig(v_size=args.v_size, s_size=args.s_size, block_size=g)
    pattern = estimate_pattern(q, k, config)
    mask = flex_block_mask(block_mask(pattern), n, g)
    rec = dict(
        kind="timing",
        seq_len=n,
        inputs="structured",
        density=float(pattern.density().mean()),
        rounded_density=float(rounded_pattern(pattern).density().mean()),
    )
    rec["cudnn_fwd_ms"], rec["cudnn_fwd_bwd_ms"] = dense_times(q, k, v, do)
    rec["ours_fwd_ms"], rec["ours_bwd_ms"], rec["ours_fwd_bwd_ms"] = sparse_times(q, k, v, do, pattern)
    rec["ours_total_ms"] = training_step_ms(q, k, v, do, config)
    if with_fa4:
        _timed(rec, "fa4", lambda: peer_times(fa4_attention_fn(mask), q, k, v, do))
    heads = [t.transpose(1, 2).contiguous() for t in (q, k, v, do)]
    _timed(rec, "flex", lambda: peer_times(flex_attention_fn(mask), *heads))
    ours, cudnn = rec["ours_fwd_bwd_ms"], rec["cudnn_fwd_bwd_ms"]
    rec["ours_over_ideal"] = ours / (rec["density"] * cudnn)
    rec["total_over_ideal"] = rec["ours_total_ms"] / (rec["density"] * cudnn)
    for name in ("fa4", "flex", "cudnn"):
        if f"{name}_fwd_bwd_ms" in rec:
            rec[f"{name}_over_ours"] = rec[f"{name}_fwd_bwd_ms"] / ours
            rec[f"{name}_fwd_over_ours"] = rec[f"{name}_fwd_ms"] / rec["ours_fwd_ms"]
            rec[f"{name}_over_ours_total"] = rec[f"{name}_fwd_bwd_ms"] / rec["ours_total_ms"]
    for name in ("fa4", "flex"):
        if f"{name}_fwd_bwd_ms" in rec:
            rec[f"{name}_over_ideal"] = rec[f"{name}_fwd_bwd_ms"] / (rec["rounded_density"] * cudnn)
    print(
        f"{n:>7} dens={rec['density']:.3f} rounded={rec['rounded_density']:.3f} ours fb={ours:.1f} "
        f"total={rec['ours_total_ms']:.1f} cudnn fb={cudnn:.1f} "
        + " ".join(
            f"{m} fb={rec[f'{m}_fwd_bwd_ms']:.1f} ({rec[f'{m}_over_ours']:.2f}x ours)"
            for m in ("fa4", "flex")
            if f"{m}_fwd_bwd_ms" in rec
        ),
        flush=True,
    )
    del q, k, v, do, pattern, mask, heads
    torch.cuda.empty_cache()
    return rec


def base_fields(args) -> dict:
    """Fields every record carries: machine, commit, command, versions, shape and budgets."""
    on_gpu = args.device == "cuda"
    return dict(
        **provenance(on_gpu),
        gpus=torch.cuda.device_count() if on_gpu else 0,
        torch=torch.__version__,
        **dict(zip(("fa4_version", "fa4_import_error"), fa4_status())),
        heads_q=args.heads_q,
        heads_kv=args.heads_kv,
        head_dim=args.head_dim,
        dtype="bfloat16",
        block_size=args.block_size,
        v_size=args.v_size,
        s_size=args.s_size,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[65536, 131072, 262144])
    add_attention_shape(p, "our G and the peers' sparse block")
    p.add_argument("--check-len", type=int, default=4096)
    p.add_argument("--check-v-size", type=int, default=16, help="budgets of the check's pattern (sparse at its length)")
    p.add_argument("--check-s-size", type=int, default=128)
    p.add_argument("--check-only", action="store_true", help="run the correctness check only (any device)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: run with --check-only --device cpu for the parts a CPU can run")
    if args.device == "cpu" and not args.check_only:
        raise SystemExit("timing needs a CUDA GPU; on a CPU pass --check-only")
    base = base_fields(args)
    with_fa4 = base["fa4_version"] is not None
    print(f"flash-attn-4: {base['fa4_version'] or base['fa4_import_error']}; torch {base['torch']}", flush=True)
    records = [dict(base, **correctness(args, args.device, with_fa4))]
    path = write_results("block_sparse_peers", records, args.out)
    for n in [] if args.check_only else args.seq_lens:
        records.append(dict(base, **timing(args, n, with_fa4)))
        write_results("block_sparse_peers", records, args.out)  # after every length: a cut-short run keeps them
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
