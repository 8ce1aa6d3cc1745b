"""Throwaway A/B: per-kernel CUDA times of the package on PYTHONPATH (dense, sparse10, estimated at 128K)."""
import sys
import torch
sys.path.insert(0, "bench")
from tune_kernels import kernel_ms  # noqa: E402
from sparse_attention import sweep_pattern, training_step_ms  # noqa: E402
import mtraining  # noqa: E402
from mtraining.ops import VerticalSlashPattern  # noqa: E402
from mtraining.ops.attention import sparse_attention  # noqa: E402
from mtraining.ops.estimate import PatternConfig, estimate_pattern  # noqa: E402
from mtraining.ops.synthetic import rope_structured_qkv  # noqa: E402

tag = sys.argv[1]
print(tag, mtraining.__file__, flush=True)
n, hq, hkv, d, g = 131072, 16, 2, 128, 128
q, k, v = rope_structured_qkv(1, n, hq, hkv, d, dtype=torch.bfloat16, device="cuda", seed=0)
qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
do = torch.randn_like(q)
cfg = PatternConfig(v_size=1024, s_size=6144, block_size=g)
pats = {"dense": VerticalSlashPattern.dense(1, hq, n, g, device="cuda"), "estimated": estimate_pattern(q, k, cfg)}
ref = {}
for name, p in pats.items():
    def step():
        qg.grad = kg.grad = vg.grad = None
        sparse_attention(qg, kg, vg, p).backward(do)
    t = kernel_ms(step)
    print(tag, name, " ".join(f"{a.strip('_')}={b:7.2f}" for a, b in sorted(t.items())), flush=True)
print(tag, "training_step_ms", round(training_step_ms(q, k, v, do, cfg), 2), flush=True)
# gradient check against the float32 torch backend on a 4K slice (catches a wrong variant)
qs, ks, vs = (t[:, :4096].detach().float().requires_grad_() for t in (q, k, v))
p4 = estimate_pattern(qs, ks, PatternConfig(v_size=256, s_size=512, block_size=g))
outs = []
for be in ("triton", "torch"):
    a = [t.detach().clone().requires_grad_() for t in (qs, ks, vs)]
    sparse_attention(*a, p4, backend=be).backward(do[:, :4096].float())
    outs.append([t.grad for t in a])
print(tag, "grad rel err", [float((x - y).norm() / y.norm()) for x, y in zip(*outs)], flush=True)
