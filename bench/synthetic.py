"""Synthetic q/k/v for tests and benchmarks: RoPE-structured (LLM-like) and plain Gaussian.

Structured model, per key/value head h (query head hq uses h = hq // (Hq / Hkv)), before RoPE:

    k_j = a * u_h + e_k(j) + [j is an anchor] * c * w_h
    q_i = a * u_h + e_q(i) + c * w_h
    v_j = e_v(j)

u_h is a random unit direction with 20% of its energy in the high-frequency half of the RoPE
pairs and 80% in the pairs whose wavelength lies in [seq_len/24, seq_len/3]; w_h is one in the
lowest-frequency eighth (pairs that barely rotate over the sequence); e_* Gaussian noise with
per-element std ``noise * a / sqrt(D)``. q and k are then rotated by RoPE (rotate-half layout,
base ``rope_base``, 1e6 as in Qwen2.5) at their positions. Scaled by 1/sqrt(D):

- a * u_h on both sides gives a logit of ``local_logit`` at distance 0: a sharp peak over the first
  tens of tokens (the fast pairs decorrelate), then a smooth band that decays over a few percent of
  the sequence (the band pairs), far above the weak far field: a local-heavy, RoPE-shaped slash
  pattern whose top slashes are the nearest offsets, as in real LLM heads;
- c * w_h meets the anchor keys with a logit of about ``anchor_logit`` at every distance:
  vertical lines at the anchors (``anchor_positions``: 0 and ``num_anchors - 1`` random positions).

Every noise element is drawn by a counter-based hash of (seed, stream, batch, position, head, dim), so
any subset of positions (a context-parallel shard) is generated directly on the device and a
position's row does not depend on which other positions were requested. Directions and anchors
come from ``torch.Generator`` seeded with ``seed`` and depend only on (seed, seq_len, heads, head_dim).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF
_ROWS_PER_CHUNK = 4096
_STREAM_Q, _STREAM_K, _STREAM_V = 1, 2, 3
_SHARP_ENERGY = 0.2  # share of the local direction in fast-rotating pairs (the rest: the smooth band)


def rope_structured_qkv(
    batch: int,
    seq_len: int,
    heads_q: int,
    heads_kv: int,
    head_dim: int,
    *,
    positions: Tensor | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    seed: int = 0,
    rope_base: float = 1e6,
    num_anchors: int = 4,
    noise: float = 0.5,
    local_logit: float = 14.0,
    anchor_logit: float = 11.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """(q [B, S', Hq, D], k [B, S', Hkv, D], v [B, S', Hkv, D]) of the structured model (module docstring).

    S' = seq_len, or len(positions) with the rows of those global positions in that order. Computed
    in float32 on ``device`` (a shard of a long sequence never needs the full one), then cast to dtype.
    """
    pos = _check_args(batch, seq_len, heads_q, heads_kv, head_dim, positions, seed, device)
    reals = {"rope_base": rope_base, "noise": noise, "local_logit": local_logit, "anchor_logit": anchor_logit}
    for name, value in reals.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if rope_base <= 1:
        raise ValueError(f"rope_base must be > 1 (RoPE frequencies base**(-2f/D)), got {rope_base}")
    anchors = anchor_positions(seq_len, num_anchors, seed).to(device)
    u, w = _directions(seed, heads_kv, head_dim, seq_len, rope_base)
    u, w = u.to(device), w.to(device)
    root_d = math.sqrt(head_dim)
    a, c = math.sqrt(local_logit * root_d), math.sqrt(anchor_logit * root_d)
    sigma = noise * a / root_d
    is_anchor = torch.isin(pos, anchors).float()[None, :, None, None]

    q = _gaussian(seed, _STREAM_Q, batch, pos, heads_q, head_dim) * sigma
    q += (a * u + c * w).repeat_interleave(heads_q // heads_kv, dim=0)
    k = _gaussian(seed, _STREAM_K, batch, pos, heads_kv, head_dim) * sigma + a * u + is_anchor * (c * w)
    v = _gaussian(seed, _STREAM_V, batch, pos, heads_kv, head_dim)
    cos, sin = _rope_tables(pos, head_dim, rope_base)
    return _rotate(q, cos, sin).to(dtype), _rotate(k, cos, sin).to(dtype), v.to(dtype)


def anchor_positions(seq_len: int, num_anchors: int, seed: int = 0) -> Tensor:
    """The anchor (vertical) key positions of ``rope_structured_qkv``: 0 and num_anchors - 1 random ones, sorted."""
    if isinstance(num_anchors, bool) or not isinstance(num_anchors, int) or not 0 <= num_anchors <= seq_len:
        raise ValueError(f"num_anchors must be an int in [0, seq_len={seq_len}], got {num_anchors!r}")
    gen = torch.Generator().manual_seed(seed)
    others = torch.randperm(seq_len - 1, generator=gen)[: max(num_anchors - 1, 0)] + 1
    return torch.cat([torch.zeros(min(num_anchors, 1), dtype=torch.int64), others]).sort().values


def local_band_directions(heads_kv: int, head_dim: int, seq_len: int, rope_base: float = 1e6, seed: int = 0) -> Tensor:
    """Unit directions [Hkv, D] (rotate-half RoPE layout) that give a local-heavy slash pattern at
    ``seq_len``: a query and a key that both carry ``a * u_h`` meet with logit ``a**2 / sqrt(D)`` at
    distance 0, decaying over a few percent of the sequence (``rope_structured_qkv``'s local part;
    also used to give randomly initialised models realistic attention for benchmarks)."""
    return _directions(seed, heads_kv, head_dim, seq_len, rope_base)[0]


def _directions(seed: int, heads_kv: int, head_dim: int, seq_len: int, rope_base: float) -> tuple[Tensor, Tensor]:
    """Unit directions [Hkv, D]: u for the local band, w for the anchors (lowest-frequency eighth of the pairs).

    u puts ``_SHARP_ENERGY`` of its energy on the high-frequency half of the RoPE pairs (a sharp
    peak at distance 0 that decorrelates within tens of tokens) and the rest on the pairs whose
    wavelength 1/theta lies in [seq_len/24, seq_len/3] (a smooth band a few percent of the sequence
    wide, whose logits stay far above the far field): a local-heavy slash pattern at any length.
    """
    gen = torch.Generator().manual_seed(seed + 1)
    half = head_dim // 2
    n_high, n_low = max(1, half // 2), max(1, head_dim // 8)
    pair = torch.arange(half)
    wavelength = rope_base ** (2 * pair.double() / head_dim)
    band = (wavelength >= seq_len / 24) & (wavelength <= seq_len / 3) & (pair >= n_high) & (pair < half - n_low)
    if not bool(band.any()):  # short sequences or tiny heads: the one pair nearest to seq_len / 8
        nearest = int((wavelength.log() - math.log(seq_len / 8)).abs()[n_high : half - n_low].argmin()) + n_high
        band = pair == nearest

    def unit_on(pairs: Tensor) -> Tensor:
        dims = torch.cat([pairs, pairs + half])
        out = torch.zeros(heads_kv, head_dim)
        out[:, dims] = torch.nn.functional.normalize(torch.randn(heads_kv, dims.numel(), generator=gen), dim=-1)
        return out

    u = math.sqrt(_SHARP_ENERGY) * unit_on(pair[:n_high]) + math.sqrt(1 - _SHARP_ENERGY) * unit_on(pair[band])
    return u, unit_on(pair[half - n_low :])


def random_qkv(
    batch: int,
    seq_len: int,
    heads_q: int,
    heads_kv: int,
    head_dim: int,
    *,
    positions: Tensor | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Standard-normal q, k, v (no structure: the worst case for a sparse pattern), same layout and
    subset guarantee as ``rope_structured_qkv``."""
    pos = _check_args(batch, seq_len, heads_q, heads_kv, head_dim, positions, seed, device)
    return (
        _gaussian(seed, _STREAM_Q, batch, pos, heads_q, head_dim).to(dtype),
        _gaussian(seed, _STREAM_K, batch, pos, heads_kv, head_dim).to(dtype),
        _gaussian(seed, _STREAM_V, batch, pos, heads_kv, head_dim).to(dtype),
    )


def _check_args(
    batch: int,
    seq_len: int,
    heads_q: int,
    heads_kv: int,
    head_dim: int,
    positions: Tensor | None,
    seed: int,
    device: torch.device | str,
) -> Tensor:
    """Validate the shared arguments; return the int64 positions on the device."""
    sizes = {"batch": batch, "seq_len": seq_len, "heads_q": heads_q, "heads_kv": heads_kv, "head_dim": head_dim}
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if heads_q % heads_kv:
        raise ValueError(f"heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv}) for GQA")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE pairs, got {head_dim}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MASK32:
        raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
    if positions is None:
        return torch.arange(seq_len, device=device)
    if not isinstance(positions, Tensor) or positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError("positions must be a 1-D int32/int64 tensor of global positions")
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= seq_len):
        raise ValueError(f"positions must lie in [0, seq_len={seq_len})")
    return positions.to(device=device, dtype=torch.int64)


def _mul32(x: Tensor, m: int) -> Tensor:
    """(x * m) mod 2**32 for x in [0, 2**32) without int64 overflow."""
    return (x * (m & 0xFFFF) + (((x * (m >> 16)) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: Tensor) -> Tensor:
    """32-bit avalanche finaliser (xor-shift / multiply)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _gaussian(seed: int, stream: int, batch: int, pos: Tensor, heads: int, head_dim: int) -> Tensor:
    """Float32 [B, len(pos), heads, head_dim] standard normals, a pure function of every index.

    One hashed pair of uniforms per (batch, position, head, pair f) gives, by Box-Muller, the
    normals of dims f and f + head_dim/2.
    """
    dev = pos.device
    half = head_dim // 2
    out = torch.empty(batch, pos.shape[0], heads, head_dim, dtype=torch.float32, device=dev)
    base = _mix32(torch.tensor(seed, dtype=torch.int64, device=dev) ^ _mix32(torch.tensor(stream, device=dev)))
    per_batch = _mix32(base ^ torch.arange(batch, device=dev))[:, None, None, None]
    pair_idx = torch.arange(heads * half, device=dev).view(1, 1, heads, half)
    for start in range(0, pos.shape[0], _ROWS_PER_CHUNK):
        rows = slice(start, start + _ROWS_PER_CHUNK)
        h = _mix32(_mix32(per_batch ^ pos[rows][None, :, None, None]) ^ pair_idx)
        radius = torch.sqrt(-2.0 * torch.log((h.float() + 0.5) / 2**32))
        angle = (_mix32(h ^ 0x9E3779B9).float() + 0.5) * (2 * math.pi / 2**32)
        out[:, rows, :, :half] = radius * torch.cos(angle)
        out[:, rows, :, half:] = radius * torch.sin(angle)
    return out


def _rope_tables(pos: Tensor, head_dim: int, base: float) -> tuple[Tensor, Tensor]:
    """cos, sin [S', 1, D] float32, angles in float64 (positions up to millions stay exact)."""
    half = head_dim // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float64, device=pos.device) * 2 / head_dim)
    angles = pos.double()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]
    return angles.cos().float(), angles.sin().float()


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE in the rotate-half layout: pair f is dims (f, f + D/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
