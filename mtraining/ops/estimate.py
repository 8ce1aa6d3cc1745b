"""Online estimation of the vertical-slash pattern from the last queries (DESIGN.md 2.2), no gradient.

Three pieces that each work on any subset of keys given by global position, so context
parallelism composes them (keys spread over ranks, the last queries broadcast):

1. ``last_query_partial_lse``: LSE of the last queries over these keys; ranks combine with logsumexp.
2. ``line_scores``: given the *global* row LSE, vertical scores of these keys and slash scores of
   every offset; ranks sum the slash scores and place the vertical scores by key position.
3. ``select_lines``: top lines per head (or the fewest reaching a mass threshold), sinks and local
   window always kept, as a ``VerticalSlashPattern``. Deterministic (stable sort, ties -> lower index).

``estimate_pattern`` runs them on one device. Keys are processed in chunks so that a
[B, Hq, last_q, chunk] score tensor holds at most ``_CHUNK_ELEMENTS`` values (256 MB in float32,
updated in place), and line selection sorts at most ``_SORT_ELEMENTS`` scores at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from .budgets import Budgets, load_budgets
from .checks import check_qkv, default_positions
from .pattern import VerticalSlashPattern, line_lists

_CHUNK_ELEMENTS = 1 << 26
_SORT_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class PatternConfig:
    """How the pattern is estimated. Budgets count lines per query head, forced lines included.

    Attributes:
        v_size: verticals kept per head (the cap in threshold mode); sinks count toward it.
        s_size: slash offsets kept per head (the cap in threshold mode); the local window counts toward it.
        last_q: how many of the last queries score the lines.
        block_size: G of the resulting VerticalSlashPattern (the kernel block size).
        sink_tokens: key positions 0..sink_tokens-1 are always verticals.
        local_window: offsets 0..local_window-1 are always slashes (>= 1: every row sees itself).
        threshold: if set, keep per head the fewest lines (forced ones first, then by score) whose
            score mass reaches this fraction of the head's total, separately for verticals and
            slashes, capped by the budgets.
        budgets: per-layer/per-head budgets (``budgets.py``); when set they replace v_size/s_size.
    """

    v_size: int = 1024
    s_size: int = 6144
    last_q: int = 64
    block_size: int = 128
    sink_tokens: int = 4
    local_window: int = 128
    threshold: float | None = None
    budgets: Budgets | None = None

    def __post_init__(self) -> None:
        for name in ("v_size", "s_size", "last_q", "local_window", "block_size"):
            _check_int(getattr(self, name), name, minimum=1)
        _check_int(self.sink_tokens, "sink_tokens", minimum=0)
        g = self.block_size
        if g < 16 or g & (g - 1):
            raise ValueError(f"block_size must be a power of two >= 16 (the kernel block), got {g}")
        t = self.threshold
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 1):
            raise ValueError(f"threshold must be None or a fraction in (0, 1] such as 0.9, got {t!r}")
        if self.budgets is not None:
            if not isinstance(self.budgets, Budgets):
                raise ValueError(f"budgets must be a Budgets (from load_budgets), got {type(self.budgets).__name__}")
            defaults = {f.name: f.default for f in fields(self)}
            if (self.v_size, self.s_size) != (defaults["v_size"], defaults["s_size"]):
                raise ValueError("pass either v_size/s_size or budgets, not both: budgets replace v_size and s_size")
            min_v, min_s = self.budgets.min_values()
            where = f" in {self.budgets.source}"
        else:
            min_v, min_s, where = self.v_size, self.s_size, ""
        if self.sink_tokens > min_v:
            raise ValueError(
                f"sink_tokens ({self.sink_tokens}) exceeds the smallest vertical budget ({min_v}{where}); "
                "sinks are part of v_size, so lower sink_tokens or raise v_size"
            )
        if self.local_window > min_s:
            raise ValueError(
                f"local_window ({self.local_window}) exceeds the smallest slash budget ({min_s}{where}); "
                "the window is part of s_size, so lower local_window or raise s_size"
            )

    @classmethod
    def from_file(cls, path: str | Path, **kwargs) -> "PatternConfig":
        """Config whose budgets come from a budgets file (see budgets.py); other fields from kwargs."""
        return cls(budgets=load_budgets(path), **kwargs)

    def head_budgets(self, layer_idx: int, num_heads: int, seq_len: int) -> tuple[Tensor, Tensor]:
        """(v_size, s_size) int64 CPU tensors [num_heads] for a layer, checked against seq_len."""
        v, s = self._budget_lists(layer_idx, num_heads, seq_len)
        return torch.tensor(v), torch.tensor(s)

    def _budget_lists(self, layer_idx: int, num_heads: int, seq_len: int) -> tuple[list[int], list[int]]:
        """``head_budgets`` as Python lists (no tensor work)."""
        _check_int(layer_idx, "layer_idx", minimum=0)
        if self.budgets is not None:
            v, s = (t.tolist() for t in self.budgets.for_layer(layer_idx, num_heads))
        else:
            v, s = [self.v_size] * num_heads, [self.s_size] * num_heads
        lines = (("v_size", v, "verticals than there are keys"), ("s_size", s, "slashes than offsets"))
        for name, budget, what in lines:
            top = max(budget)
            if top > seq_len:
                raise ValueError(
                    f"{name} {top} (layer {layer_idx}, head {budget.index(top)}) exceeds the sequence length "
                    f"{seq_len}: a head cannot keep more {what}; lower {name} to at most {seq_len}"
                )
        return v, s


@torch.no_grad()
def last_query_partial_lse(q_last: Tensor, q_last_pos: Tensor, k: Tensor, k_pos: Tensor, scale: float) -> Tensor:
    """Float32 LSE [B, Hq, R] of the rows q_last [B, R, Hq, D] over the keys k [B, Sk, Hkv, D].

    Causal by global position; -inf where none of these keys is allowed. Partial LSEs over
    disjoint key sets combine exactly with ``torch.logaddexp`` (or logsumexp over ranks).
    """
    q_last_pos, k_pos = _check_line_inputs(q_last, q_last_pos, k, k_pos)
    return _partial_lse(q_last, q_last_pos, k, k_pos, scale, _plan(q_last_pos, k_pos, _values_per_key(q_last)))


def _partial_lse(q_last: Tensor, q_last_pos: Tensor, k: Tensor, k_pos: Tensor, scale: float, plan) -> Tensor:
    b, r, hq, _ = q_last.shape
    chunks, _ = plan
    qs = _grouped_queries(q_last, k.shape[2])
    lse = torch.full((b, hq, r), float("-inf"), dtype=_acc_dtype(q_last), device=q_last.device)
    for start, stop, partly_causal in chunks:
        s = _scores(qs, k[:, start:stop].permute(0, 2, 3, 1)).mul_(scale).view(b, hq, r, stop - start)
        if partly_causal:
            s.masked_fill_(k_pos[None, start:stop] > q_last_pos[:, None], float("-inf"))
        lse = torch.logaddexp(lse, torch.logsumexp(s, dim=-1))  # rows with no key here: -inf
    return lse.float()


@torch.no_grad()
def line_scores(
    q_last: Tensor, q_last_pos: Tensor, k: Tensor, k_pos: Tensor, scale: float, row_lse: Tensor, seq_len: int
) -> tuple[Tensor, Tensor]:
    """Vertical and slash scores of the rows q_last over the keys k, given the global row LSE.

    With p[r, j] = exp(q_r . k_j * scale - row_lse[r]) on causal pairs, returns
    (vertical [B, Hq, Sk] float32: sum_r p[r, j], in the order of k_pos;
     slash [B, Hq, seq_len] float32: sum of p[r, j] over pairs with q_pos_r - k_pos_j = d).
    Slash sums use a strided diagonal sum when rows and keys are contiguous runs of positions
    (no atomics, deterministic) and ``index_add_`` otherwise (on CUDA the order of float additions
    may vary between runs unless torch.use_deterministic_algorithms(True)).
    """
    q_last_pos, k_pos = _check_line_inputs(q_last, q_last_pos, k, k_pos)
    b, r, hq, _ = q_last.shape
    _check_int(seq_len, "seq_len", minimum=1)
    if row_lse.shape != (b, hq, r) or not row_lse.is_floating_point() or row_lse.device != q_last.device:
        raise ValueError(
            f"row_lse must be a float tensor [B, Hq, R] = {(b, hq, r)} on {q_last.device}, got "
            f"{tuple(row_lse.shape)} {row_lse.dtype} on {row_lse.device}; pass the global LSE of these rows"
        )
    plan = _plan(q_last_pos, k_pos, _values_per_key(q_last))
    return _line_scores(q_last, q_last_pos, k, k_pos, scale, row_lse, seq_len, plan)


def _line_scores(
    q_last: Tensor, q_last_pos: Tensor, k: Tensor, k_pos: Tensor, scale: float, row_lse: Tensor, seq_len: int, plan
) -> tuple[Tensor, Tensor]:
    b, r, hq, _ = q_last.shape
    sk = k.shape[1]
    chunks, (q_lo, q_hi, k_lo, k_hi, runs) = plan
    if q_lo < 0 or k_lo < 0 or q_hi >= seq_len or k_hi >= seq_len:
        raise ValueError(
            f"positions must lie in [0, seq_len={seq_len}): q_last_pos spans [{q_lo}, {q_hi}], k_pos spans "
            f"[{k_lo}, {k_hi}]; pass the global sequence length"
        )
    bh = b * hq
    qg = _grouped_queries(q_last, k.shape[2])
    acc = _acc_dtype(q_last)
    lse_rows = torch.where(torch.isfinite(row_lse), row_lse, torch.zeros_like(row_lse)).to(acc)[..., None]
    vertical = torch.empty(b, hq, sk, dtype=torch.float32, device=q_last.device)
    slash = torch.zeros(bh, seq_len + 1, dtype=acc, device=q_last.device)  # last slot: non-causal pairs
    for start, stop, partly_causal in chunks:
        c = stop - start
        # contiguous: keys reversed and R padding columns, so diagonals are strided views (_add_diagonal_sums)
        pad = r if runs else 0
        p = _scores(qg, _padded_keys(k, start, stop, pad, runs)).view(b, hq, r, c + pad)
        p.mul_(scale).sub_(lse_rows)
        if partly_causal:
            kp = k_pos[start:stop].flip(0) if runs else k_pos[start:stop]
            p[..., :c].masked_fill_(kp[None, :] > q_last_pos[:, None], float("-inf"))
        p.exp_()  # p[..., r, j] = exp(q_r . k_j * scale - row_lse[r])
        if pad:
            p[..., c:] = 0.0  # padding columns carry no probability
        if runs:
            vertical[..., start:stop] = p[..., :c].sum(dim=-2).flip(-1)
            _add_diagonal_sums(slash, p.view(bh, r, c + r), q_lo - (k_lo + start))
        else:
            vertical[..., start:stop] = p.sum(dim=-2)
            offsets = q_last_pos[:, None] - k_pos[None, start:stop]
            slash.index_add_(1, torch.where(offsets >= 0, offsets, seq_len).flatten(), p.view(bh, -1))
    return vertical, slash[:, :seq_len].float().view(b, hq, seq_len)


@torch.no_grad()
def select_lines(
    vertical_scores: Tensor, slash_scores: Tensor, config: PatternConfig, seq_len: int, layer_idx: int = 0
) -> VerticalSlashPattern:
    """Pick the lines of every head from global scores and build the pattern.

    vertical_scores [B, Hq, seq_len] (index = key position), slash_scores [B, Hq, seq_len]
    (index = offset). Keeps the top budget lines per head (see PatternConfig.threshold for the
    mass mode), always including sinks and the local window. Ties go to the lower index, so
    identical scores give an identical pattern on every rank. One device sync.
    """
    if not isinstance(config, PatternConfig):
        raise ValueError(f"config must be a PatternConfig, got {type(config).__name__}")
    _check_int(seq_len, "seq_len", minimum=1)
    for name, t in (("vertical_scores", vertical_scores), ("slash_scores", slash_scores)):
        if not isinstance(t, Tensor) or t.dim() != 3 or t.shape[-1] != seq_len or not t.is_floating_point():
            shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a float tensor [B, Hq, seq_len={seq_len}], got {shape}")
    if vertical_scores.shape != slash_scores.shape or vertical_scores.device != slash_scores.device:
        raise ValueError(
            f"vertical_scores {tuple(vertical_scores.shape)} and slash_scores {tuple(slash_scores.shape)} must "
            "have one shape and device"
        )
    budgets = config._budget_lists(layer_idx, vertical_scores.shape[1], seq_len)
    return _select_lines(vertical_scores, slash_scores, config, seq_len, *budgets)


def _select_lines(
    vertical_scores: Tensor, slash_scores: Tensor, config: PatternConfig, seq_len: int, v_budget, s_budget
) -> VerticalSlashPattern:
    verticals = _top_lines(vertical_scores, v_budget, config.sink_tokens, config.threshold)
    slashes = _top_lines(slash_scores, s_budget, config.local_window, config.threshold)
    lists = line_lists(verticals, slashes, seq_len, config.block_size)
    named = (("vertical_scores", vertical_scores), ("slash_scores", slash_scores))
    bounds = [bound for _, t in named for bound in torch.aminmax(t)]  # NaN anywhere gives NaN bounds
    # the score checks and the list widths in one device sync (in float64: widths stay exact)
    *bounds, diag_width, vertical_width = torch.stack([bounds[0].double(), *bounds[1:], *lists.widths()]).tolist()
    for (name, _), lo, hi in zip(named, bounds[::2], bounds[1::2]):
        if not (lo >= 0 and hi < math.inf):
            raise ValueError(f"{name} has negative, NaN or infinite entries; check q and k for non-finite values")
    return lists.pattern(seq_len, config.block_size, int(diag_width), int(vertical_width))


@torch.no_grad()
def estimate_pattern(
    q: Tensor,
    k: Tensor,
    config: PatternConfig,
    q_pos: Tensor | None = None,
    k_pos: Tensor | None = None,
    layer_idx: int = 0,
    softmax_scale: float | None = None,
) -> VerticalSlashPattern:
    """Single-device estimate: q [B, Sq, Hq, D], k [B, S, Hkv, D] holding the whole sequence.

    The ``config.last_q`` rows with the largest positions score the lines. Positions default to
    keys 0..S-1 and queries the last Sq of them; k_pos must hold each of 0..S-1 once.
    """
    if not isinstance(config, PatternConfig):
        raise ValueError(f"config must be a PatternConfig, got {type(config).__name__}")
    check_qkv(q, k, k)
    given_q, given_k = q_pos is not None, k_pos is not None
    q_pos, k_pos = default_positions(q, k, q_pos, k_pos)
    b, sq, hq, d = q.shape
    seq_len = k.shape[1]
    if config.last_q > sq:
        raise ValueError(f"last_q ({config.last_q}) exceeds the {sq} query rows; lower last_q to at most {sq}")
    budgets = config._budget_lists(layer_idx, hq, seq_len)  # fail on budgets before any work
    everything = torch.arange(seq_len, device=k_pos.device, dtype=k_pos.dtype)
    if given_k and not torch.equal(torch.sort(k_pos).values, everything):
        raise ValueError(
            f"k_pos must hold each position 0..{seq_len - 1} once (the whole sequence); for a subset of keys "
            "compose last_query_partial_lse, line_scores and select_lines"
        )
    rows = torch.sort(q_pos, stable=True).indices[-config.last_q :] if given_q else slice(sq - config.last_q, sq)
    q_last, q_last_pos = q[:, rows], q_pos[rows]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    q_last_pos, k_pos = _check_line_inputs(q_last, q_last_pos, k, k_pos)
    plan = _plan(q_last_pos, k_pos, _values_per_key(q_last))  # one device sync serves both passes
    lse = _partial_lse(q_last, q_last_pos, k, k_pos, scale, plan)
    vertical, slash = _line_scores(q_last, q_last_pos, k, k_pos, scale, lse, seq_len, plan)
    if given_k:  # scores follow k's row order; the pattern indexes them by position
        vertical = torch.empty_like(vertical).index_copy_(-1, k_pos.long(), vertical)
    return _select_lines(vertical, slash, config, seq_len, *budgets)


# --------------------------------------------------------------------------- helpers
def _check_int(value: object, name: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_line_inputs(q_last: Tensor, q_last_pos: Tensor, k: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
    check_qkv(q_last, k, k)
    if q_last.shape[1] == 0 or k.shape[1] == 0:
        raise ValueError(f"need at least one row and one key, got q_last {tuple(q_last.shape)}, k {tuple(k.shape)}")
    if q_last_pos is None or k_pos is None:
        raise ValueError("q_last_pos and k_pos are required: the global positions of the rows and keys")
    q_last_pos, k_pos = default_positions(q_last, k, q_last_pos, k_pos)
    return q_last_pos.long(), k_pos.long()


def _values_per_key(q_last: Tensor) -> int:
    """Scores per key of the rows q_last [B, R, Hq, D]: B * Hq * R."""
    b, r, hq, _ = q_last.shape
    return b * hq * r


def _plan(
    q_pos: Tensor, k_pos: Tensor, values_per_key: int
) -> tuple[list[tuple[int, int, bool]], tuple[int, int, int, int, bool]]:
    """Key chunks and position facts, in one device sync.

    Returns ([(start, stop, has non-causal pairs)], (q min, q max, k min, k max, rows and keys are
    both ascending runs of consecutive positions)). A chunk's [B, Hq, R, C] tensor holds at most
    _CHUNK_ELEMENTS values.
    """
    n = k_pos.shape[0]
    step = max(1, _CHUNK_ELEMENTS // max(values_per_key, 1))
    num = -(-n // step)
    chunk_max = F.pad(k_pos, (0, num * step - n), value=-1).view(num, step).amax(1)
    runs = (q_pos.diff() == 1).all() & (k_pos.diff() == 1).all()
    facts = torch.stack([q_pos.min(), q_pos.max(), k_pos.min(), k_pos.max(), runs.long()])
    values = torch.cat([facts, (chunk_max > q_pos.min()).long()]).tolist()
    chunks = [(i * step, min((i + 1) * step, n), bool(values[5 + i])) for i in range(num)]
    return chunks, (*values[:4], bool(values[4]))


def _acc_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _grouped_queries(q_last: Tensor, kv_heads: int) -> Tensor:
    """[B, R, Hq, D] -> [B, Hkv, group * R, D] (head h uses kv head h // group), for ``_scores``."""
    b, r, hq, d = q_last.shape
    return q_last.transpose(1, 2).reshape(b, kv_heads, (hq // kv_heads) * r, d)


def _scores(q: Tensor, keys: Tensor) -> Tensor:
    """q [B, Hkv, M, D] @ keys [B, Hkv, D, C] in float32 (float64 for float64 inputs), a new tensor.

    Half-precision inputs on CUDA multiply on the tensor cores with a float32 result: their
    products are exact and they add in float32, as the float32 matmul of the upcast inputs would.
    """
    b, h, m, d = q.shape
    c = keys.shape[-1]
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        out = torch.bmm(q.reshape(b * h, m, d), keys.to(q.dtype).reshape(b * h, d, c), out_dtype=torch.float32)
        return out.view(b, h, m, c)
    acc = _acc_dtype(q)
    return torch.matmul(q.to(acc), keys.to(acc))


def _padded_keys(k: Tensor, start: int, stop: int, pad: int, reverse: bool) -> Tensor:
    """[B, Hkv, D, C + pad]: keys start..stop-1 (reversed if asked), then ``pad`` zero columns."""
    keys = k[:, start:stop]
    keys = (keys.flip(1) if reverse else keys).permute(0, 2, 3, 1)
    return F.pad(keys, (0, pad)) if pad else keys


def _add_diagonal_sums(slash: Tensor, p: Tensor, base: int) -> None:
    """slash[:, base + r - c] += P[:, r, c] for contiguous rows and keys (base = q0 - k0).

    p [BH, R, C + R] holds P with its keys reversed in the first C columns and zeros in the last R.
    Re-viewing the flat buffer with row length C + R - 1 shifts row r by r, so column u collects
    the pairs with r + (C-1-c) = u, i.e. offset base - (C-1) + u.
    """
    bh, r, width = p.shape
    c = width - r
    sums = p.view(bh, -1)[:, : r * (c + r - 1)].view(bh, r, c + r - 1).sum(1)
    d_lo = base - (c - 1)  # offset of sums[:, 0]
    lo = max(d_lo, 0)
    slash[:, lo : d_lo + c + r - 1] += sums[:, lo - d_lo :]


def _top_lines(scores: Tensor, budget: list[int], forced: int, threshold: float | None) -> Tensor:
    """Kept line indices [B, H, max budget], -1 padded: forced lines 0..forced-1, then by score."""
    b, h, n = scores.shape
    width = max(budget)
    same = min(budget) == width  # every head keeps `width` lines in top-k mode: no padding
    cap = None if same else torch.tensor(budget, device=scores.device)
    step = max(1, _SORT_ELEMENTS // (b * n))
    parts = []
    for lo in range(0, h, step):
        part = scores[:, lo : lo + step]
        key = part.clone()
        if forced:
            key[..., :forced].fill_(float("inf"))
        order = torch.sort(key, dim=-1, descending=True, stable=True).indices
        del key
        count = None if same else cap[lo : lo + step]
        if threshold is not None:
            mass = part.gather(-1, order).double().cumsum(-1)
            reached = ((mass < threshold * mass[..., -1:]).sum(-1) + 1).clamp(min=forced)
            count = reached.clamp(max=width) if same else torch.minimum(reached, count)
        top = order[..., :width]
        if count is not None:
            top = torch.where(torch.arange(width, device=scores.device) < count[..., None], top, -1)
        parts.append(top)
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)
