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
updated in place), and line selection sorts at most ``_SORT_ELEMENTS`` scores at a time. The
chunks and the position facts they need come from a ``PositionPlan``: known on the host for
default positions, else fetched in one device sync (passes 1 and 2 take one to share it).
``select_lines`` syncs once (score checks and list widths together).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ..checks import check_qkv, default_positions, resolve_scale
from ..documents import Documents, resolve_documents
from ..numerics import acc_dtype, matmul_acc
from ..pattern.vertical_slash import VerticalSlashPattern, line_lists
from .block_columns import Scorer, select_block_columns
from .budgets import Budgets, load_budgets

_CHUNK_ELEMENTS = 1 << 26
_SORT_ELEMENTS = 1 << 22
_MIN_RUN = 16  # keys in shorter runs (never from a layout: G >= 16) take the general path, unless one run


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
        block_columns: key columns chosen per query block of ``block_size`` rows on top of the lines
            (``block_columns.py``); 0: none.
        column_tables, column_bits: the sign hashes whose bucket mates are the block columns' candidates.
        column_scorer: how the candidates are found and scored (``block_columns.py``): "sorted" (each table's
            keys sorted by code, only the candidate pairs scored) or "dense" (every pair scored, then masked).
        column_cap: "sorted" only: a row meets at most this many keys per table, those of its bucket nearest
            its block (``column_buckets.py``); 0: no cap.
    """

    v_size: int = 1024
    s_size: int = 6144
    last_q: int = 64
    block_size: int = 128
    sink_tokens: int = 4
    local_window: int = 128
    threshold: float | None = None
    budgets: Budgets | None = None
    block_columns: int = 0
    column_tables: int = 8
    column_bits: int = 8
    column_scorer: Scorer = "sorted"
    column_cap: int = 0

    def __post_init__(self) -> None:
        for name in ("v_size", "s_size", "last_q", "local_window", "block_size", "column_tables", "column_bits"):
            _check_int(getattr(self, name), name, minimum=1)
        _check_int(self.sink_tokens, "sink_tokens", minimum=0)
        _check_int(self.block_columns, "block_columns", minimum=0)
        if self.column_scorer not in ("sorted", "dense"):
            raise ValueError(f"column_scorer must be 'sorted' or 'dense', got {self.column_scorer!r}")
        _check_int(self.column_cap, "column_cap", minimum=0)
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
    def from_settings(cls, budgets: str | Path | Budgets | None = None, **fields: float | None) -> PatternConfig:
        """The config of attention settings (the training config's attention section, eval's options): the
        one place either builds it. Fields left None take their defaults; ``budgets``, a budgets file
        (budgets.py) or loaded ``Budgets``, replaces v_size and s_size."""
        given = {name: value for name, value in fields.items() if value is not None}
        if budgets is not None and not isinstance(budgets, Budgets):
            budgets = load_budgets(budgets)
        return cls(budgets=budgets, **given)

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


@dataclass(frozen=True)
class PositionPlan:
    """What the passes over one set of rows and keys need to know about their positions, on the host.

    Attributes:
        rows, keys: how many rows (last queries) and keys it describes.
        q_lo, q_hi, k_lo, k_hi: smallest and largest row and key position.
        run: > 0 when the rows are consecutive ascending positions and the keys, in their order, come
            in runs of ``run`` consecutive ascending positions (the last run may be shorter; ``run ==
            keys``: one contiguous run); then slash sums are strided diagonal sums. 0 otherwise.
        late: (first, last) key index of the keys after the first row's position (keys some row may
            not see), or None when every row sees every key. Chunks outside it need no causal mask.
    """

    rows: int
    keys: int
    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    run: int
    late: tuple[int, int] | None

    @classmethod
    def contiguous(cls, q_lo: int, rows: int, k_lo: int, keys: int) -> PositionPlan:
        """Rows q_lo.., keys k_lo.., both consecutive: known on the host, no device work."""
        first_late = max(q_lo + 1 - k_lo, 0)
        late = (first_late, keys - 1) if first_late < keys else None
        return cls(rows, keys, q_lo, q_lo + rows - 1, k_lo, k_lo + keys - 1, keys, late)

    @classmethod
    def from_positions(cls, q_pos: Tensor, k_pos: Tensor) -> PositionPlan:
        """From 1-D integer position tensors in one device sync (none for CPU tensors)."""
        return _fetch_plan(q_pos, k_pos)[0]

    def chunks(self, values_per_key: int) -> list[tuple[int, int, int, bool]]:
        """Key chunks (start, stop, run, partly causal) whose [.., R, C] tensors hold ~_CHUNK_ELEMENTS values.

        values_per_key: scores per key (B * Hq * R). ``run``: the chunk's keys are (stop - start) / run
        runs of ``run`` consecutive ascending positions (0: no such structure). With runs, a chunk holds
        whole runs and their padding columns within the budget; runs longer than a chunk are cut into
        pieces (each one run); a shorter last run is a chunk of its own.
        """
        step = max(1, _CHUNK_ELEMENTS // max(values_per_key, 1))
        n, run = self.keys, self.run
        if run == 0:
            spans = [(a, b, 0) for a, b in _pieces(0, n, step)]
        elif run >= step:
            spans = [(a, b, b - a) for lo in range(0, n, run) for a, b in _pieces(lo, min(lo + run, n), step)]
        else:
            whole = n - n % run
            spans = [(a, b, run) for a, b in _pieces(0, whole, max(1, step // (run + self.rows)) * run)]
            if whole < n:
                spans.append((whole, n, n - whole))
        late = self.late
        return [(a, b, r, late is not None and a <= late[1] and b > late[0]) for a, b, r in spans]

    def late_keys(self, start: int, stop: int) -> tuple[int, int]:
        """Of a partly causal chunk of keys [start, stop): the keys [lo, hi) that some row may not see (the
        causal mask's only work); every row sees the others."""
        if self.late is None:
            return start, start
        return max(self.late[0], start), min(self.late[1] + 1, stop)


def _fetch_plan(q_pos: Tensor, k_pos: Tensor, checks: tuple[Tensor, ...] = ()) -> tuple[PositionPlan, list]:
    """PositionPlan of these positions and the values of the 0-d ``checks`` tensors, in one device sync."""
    n = k_pos.shape[0]
    index = torch.arange(n, device=k_pos.device)
    breaks = F.pad(k_pos.diff() != 1, (1, 0))  # key i does not continue key i - 1
    first_run = torch.where(breaks, index, n).amin()  # length of the first run (n: one run)
    off_grid = (breaks & (index % first_run != 0)).any()  # a run starts elsewhere than every first_run keys
    q_lo, q_hi = torch.aminmax(q_pos)
    k_lo, k_hi = torch.aminmax(k_pos)
    late = k_pos > q_lo
    late_lo, late_hi = torch.where(late, index, n).amin(), torch.where(late, index, -1).amax()
    consecutive = (q_pos.diff() == 1).all()
    facts = [q_lo, q_hi, k_lo, k_hi, consecutive, first_run, off_grid, late_lo, late_hi, *checks]
    values = torch.stack(facts).tolist()  # the one device sync
    q_lo, q_hi, k_lo, k_hi, consecutive, first_run, off_grid, late_lo, late_hi = (int(v) for v in values[:9])
    run = first_run if consecutive and not off_grid and (first_run == n or first_run >= _MIN_RUN) else 0
    late = (late_lo, late_hi) if late_lo < n else None
    return PositionPlan(q_pos.shape[0], n, q_lo, q_hi, k_lo, k_hi, run, late), values[9:]


def _pieces(lo: int, hi: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, hi)) for a in range(lo, hi, size)]


@torch.no_grad()
def last_query_partial_lse(
    q_last: Tensor, q_last_pos: Tensor, k: Tensor, k_pos: Tensor, scale: float, plan: PositionPlan | None = None
) -> Tensor:
    """Float32 LSE [B, Hq, R] of the rows q_last [B, R, Hq, D] over the keys k [B, Sk, Hkv, D].

    Causal by global position; -inf where none of these keys is allowed. Partial LSEs over
    disjoint key sets combine exactly with ``torch.logaddexp`` (or logsumexp over ranks).
    ``plan``: ``PositionPlan.from_positions(q_last_pos, k_pos)`` if already known (saves its device sync).
    """
    q_last_pos, k_pos = _check_line_inputs(q_last, q_last_pos, k, k_pos)
    plan = _checked_plan(plan, q_last_pos, k_pos)
    qg = grouped_queries(q_last, k.shape[2])
    b, r, hq, _ = q_last.shape
    lse = None
    for start, stop, _, partly_causal in plan.chunks(b * hq * r):
        s = grouped_scores(qg, k[:, start:stop].permute(0, 2, 3, 1)).mul_(scale).view(b, hq, r, stop - start)
        if partly_causal:
            lo, hi = plan.late_keys(start, stop)
            s[..., lo - start : hi - start].masked_fill_(k_pos[lo:hi] > q_last_pos[:, None], float("-inf"))
        part = torch.logsumexp(s, dim=-1)  # rows with no key here: -inf
        lse = part if lse is None else torch.logaddexp(lse, part)
    return lse.float()


@torch.no_grad()
def line_scores(
    q_last: Tensor,
    q_last_pos: Tensor,
    k: Tensor,
    k_pos: Tensor,
    scale: float,
    row_lse: Tensor,
    seq_len: int,
    plan: PositionPlan | None = None,
    into: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Vertical and slash scores of the rows q_last over the keys k, given the global row LSE.

    With p[r, j] = exp(q_r . k_j * scale - row_lse[r]) on causal pairs, returns
    (vertical [B, Hq, Sk] float32: sum_r p[r, j], in the order of k_pos;
     slash [B, Hq, seq_len] float32: sum of p[r, j] over pairs with q_pos_r - k_pos_j = d).
    When rows are consecutive and keys come in runs of consecutive positions (every layout:
    ``PositionPlan.run``), slash sums are strided diagonal sums: no atomics for one contiguous run,
    one small ``index_add_`` of per-run sums otherwise. Other positions add every probability with
    ``index_add_`` (on CUDA the order of float additions may then vary between runs unless
    torch.use_deterministic_algorithms(True)). ``plan``: as in ``last_query_partial_lse``. ``into``: a
    [B * Hq, seq_len + 1] buffer in the accumulation dtype to add the slash sums to (several calls over
    disjoint rows, as packed documents make), else a new one.
    """
    q_last_pos, k_pos = _check_line_inputs(q_last, q_last_pos, k, k_pos)
    b, r, hq, _ = q_last.shape
    _check_int(seq_len, "seq_len", minimum=1)
    if row_lse.shape != (b, hq, r) or not row_lse.is_floating_point() or row_lse.device != q_last.device:
        raise ValueError(
            f"row_lse must be a float tensor [B, Hq, R] = {(b, hq, r)} on {q_last.device}, got "
            f"{tuple(row_lse.shape)} {row_lse.dtype} on {row_lse.device}; pass the global LSE of these rows"
        )
    plan = _checked_plan(plan, q_last_pos, k_pos)
    qg = grouped_queries(q_last, k.shape[2])
    if plan.q_lo < 0 or plan.k_lo < 0 or plan.q_hi >= seq_len or plan.k_hi >= seq_len:
        raise ValueError(
            f"positions must lie in [0, seq_len={seq_len}): q_last_pos spans [{plan.q_lo}, {plan.q_hi}], k_pos "
            f"spans [{plan.k_lo}, {plan.k_hi}]; pass the global sequence length"
        )
    bh = b * hq
    acc = acc_dtype(qg)
    lse_rows = row_lse.to(acc).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)[..., None]  # rows seeing no key: 0
    vertical = torch.empty(b, hq, plan.keys, dtype=torch.float32, device=qg.device)
    slash = torch.zeros(bh, seq_len + 1, dtype=acc, device=qg.device) if into is None else into  # last: non-causal
    for start, stop, run, partly_causal in plan.chunks(bh * r):
        if run:
            # keys reversed within each run, then R zero columns: diagonals become strided views (_diagonal_sums)
            m = (stop - start) // run
            p = grouped_scores(qg, _run_keys(k, start, m, run, r)).view(b, hq, r, m, run + r)
            real = p[..., :run]  # the padding columns hold q . 0 = 0 and stay so
            real.mul_(scale).sub_(lse_rows[..., None])
            if partly_causal:  # the runs j0..j1-1 holding late keys; within one run, its columns c0..c1-1
                lo, hi = plan.late_keys(start, stop)
                j0, j1 = (lo - start) // run, (hi - 1 - start) // run + 1
                if j1 - j0 == 1:  # column c of reversed run j0 holds key end - 1 - c
                    end = start + j1 * run
                    c0, c1, kp = end - hi, end - lo, k_pos[lo:hi].flip(-1)[None]
                else:
                    c0, c1, kp = 0, run, k_pos[start + j0 * run : start + j1 * run].view(j1 - j0, run).flip(-1)
                real[..., j0:j1, c0:c1].masked_fill_(kp > q_last_pos[:, None, None], float("-inf"))
            real.exp_()  # p[..., r, j, c] = exp(q_r . k * scale - row_lse[r]), k the key c places from run j's end
            vertical[..., start:stop] = real.sum(dim=2).flip(-1).flatten(-2)
            sums = _diagonal_sums(p.view(bh, r, m * (run + r)))
            if plan.run == plan.keys:  # one contiguous run: the offsets are known here
                _add_contiguous(slash, sums, plan.q_lo - (plan.k_lo + start) - (run - 1))
            else:  # run j's sums start at offset q_lo - (its last key's position)
                first = plan.q_lo - (run - 1) - k_pos[start:stop:run]
                offsets = (first[:, None] + torch.arange(run + r, device=qg.device)).flatten()[:-1]  # per column
                if partly_causal:  # non-causal diagonals (all zero) go to the last slot
                    offsets.masked_fill_(offsets < 0, seq_len)
                slash.index_add_(1, offsets, sums)
        else:
            p = grouped_scores(qg, k[:, start:stop].permute(0, 2, 3, 1)).view(b, hq, r, stop - start)
            p.mul_(scale).sub_(lse_rows)
            if partly_causal:
                lo, hi = plan.late_keys(start, stop)
                p[..., lo - start : hi - start].masked_fill_(k_pos[lo:hi] > q_last_pos[:, None], float("-inf"))
            p.exp_()
            vertical[..., start:stop] = p.sum(dim=-2)
            offsets = q_last_pos[:, None] - k_pos[start:stop]
            slash.index_add_(1, torch.where(offsets >= 0, offsets, seq_len).flatten(), p.view(bh, -1))
    return vertical, slash[:, :seq_len].float().view(b, hq, seq_len)


@torch.no_grad()
def select_lines(
    vertical_scores: Tensor,
    slash_scores: Tensor,
    config: PatternConfig,
    seq_len: int,
    layer_idx: int = 0,
    documents: Documents | None = None,
) -> VerticalSlashPattern:
    """Pick the lines of every head from global scores and build the pattern.

    vertical_scores [B, Hq, seq_len] (index = key position), slash_scores [B, Hq, seq_len]
    (index = offset). Keeps the top budget lines per head (see PatternConfig.threshold for the
    mass mode), always including sinks and the local window. Ties go to the lower index, so
    identical scores give an identical pattern on every rank. One device sync. With packed
    ``documents`` the sinks are the first ``sink_tokens`` of every document, forced while the vertical
    budget lasts (earlier documents first).
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
    documents = resolve_documents(documents, vertical_scores.shape[0], seq_len)
    return _select_lines(vertical_scores, slash_scores, config, seq_len, *budgets, documents)


def _select_lines(
    vertical_scores: Tensor,
    slash_scores: Tensor,
    config: PatternConfig,
    seq_len: int,
    v_budget,
    s_budget,
    documents: Documents | None = None,
) -> VerticalSlashPattern:
    if documents is None:
        verticals = _top_lines(vertical_scores, v_budget, config.sink_tokens, config.threshold)
    else:
        sinks, count = _sinks_and_count(documents, config.sink_tokens, vertical_scores.device)
        verticals = _top_lines(vertical_scores, v_budget, count, config.threshold, sinks)
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
    documents: Documents | None = None,
) -> VerticalSlashPattern:
    """Single-device estimate: q [B, Sq, Hq, D], k [B, S, Hkv, D] holding the whole sequence.

    The ``config.last_q`` rows with the largest positions score the lines. Positions default to
    keys 0..S-1 and queries the last Sq of them; k_pos must hold each of 0..S-1 once. With default
    positions the position plan is known on the host: one device sync in all (``select_lines``).
    With packed ``documents`` (default positions, Sq = S) the last ``last_q`` rows of every document score
    against their own document's keys (``scoring_rows``) and every document's first sinks are forced.
    With ``config.block_columns`` every query block also gets its own columns (``block_columns.py``; every
    query of the sequence at default positions).
    """
    if not isinstance(config, PatternConfig):
        raise ValueError(f"config must be a PatternConfig, got {type(config).__name__}")
    if config.block_columns and (q_pos is not None or k_pos is not None or q.shape[1] != k.shape[1]):
        raise ValueError(
            "per-block columns (block_columns) rank every query block, so they need q and k of the whole sequence at "
            "default positions; under context parallelism use estimate_pattern_cp"
        )
    lines = _estimate_lines(q, k, config, q_pos, k_pos, layer_idx, softmax_scale, documents)
    if not config.block_columns:
        return lines
    scale = resolve_scale(softmax_scale, q.shape[-1])
    documents = resolve_documents(documents, q.shape[0], k.shape[1])
    return lines.with_block_columns(block_columns_of(q, k, lines, config, scale, layer_idx, documents=documents))


def block_columns_of(
    q: Tensor,
    k: Tensor,
    lines: VerticalSlashPattern,
    config: PatternConfig,
    scale: float,
    layer_idx: int,
    q_pos: Tensor | None = None,
    documents: Documents | None = None,
) -> Tensor:
    """``select_block_columns`` with the config's column settings (hashes seeded by the layer)."""
    return select_block_columns(
        q,
        k,
        lines,
        config.block_columns,
        scale,
        q_pos,
        documents,
        config.column_tables,
        config.column_bits,
        layer_idx,
        scorer=config.column_scorer,
        cap=(config.column_cap or None) if config.column_scorer == "sorted" else None,
    )


def _estimate_lines(
    q: Tensor,
    k: Tensor,
    config: PatternConfig,
    q_pos: Tensor | None,
    k_pos: Tensor | None,
    layer_idx: int,
    softmax_scale: float | None,
    documents: Documents | None,
) -> VerticalSlashPattern:
    """``estimate_pattern``'s vertical-slash lines."""
    check_qkv(q, k, k)
    b, sq, hq, d = q.shape
    seq_len, last_q = k.shape[1], config.last_q
    if last_q > sq:
        raise ValueError(f"last_q ({last_q}) exceeds the {sq} query rows; lower last_q to at most {sq}")
    budgets = config._budget_lists(layer_idx, hq, seq_len)  # fail on budgets before any work
    scale = resolve_scale(softmax_scale, d)
    documents = resolve_documents(documents, b, seq_len)
    if documents is not None:
        if q_pos is not None or k_pos is not None or sq != seq_len:
            raise ValueError(
                "estimating with documents needs every query of the sequence at default positions (q and k of "
                "the whole packed sequence); under context parallelism use estimate_pattern_cp"
            )
        each = documents.batch > 1  # per batch row where the rows' boundaries differ
        parts = []
        for i in range(b if each else 1):
            rows = document_rows(documents, i, last_q, _whole_sequence(seq_len), "whole", q.device)
            parts.append(document_scores(q[i : i + 1] if each else q, k[i : i + 1] if each else k, scale, rows))
        vertical, slash = (torch.cat(scores) for scores in zip(*parts))
        return _select_lines(vertical, slash, config, seq_len, *budgets, documents)
    given_k = k_pos is not None
    if q_pos is None and not given_k and sq <= seq_len:  # keys 0..S-1, queries the last Sq of them
        q_last = q[:, sq - last_q :]
        q_last_pos = torch.arange(seq_len - last_q, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=k.device)
        plan = PositionPlan.contiguous(seq_len - last_q, last_q, 0, seq_len)
    else:
        given_q = q_pos is not None
        q_pos, k_pos = default_positions(q, k, q_pos, k_pos)
        rows = torch.sort(q_pos, stable=True).indices[-last_q:] if given_q else slice(sq - last_q, sq)
        q_last, q_last_pos, k_pos = q[:, rows], q_pos[rows].long(), k_pos.long()
        checks = ()
        if given_k:  # checked in the plan's sync
            checks = ((torch.sort(k_pos).values == torch.arange(seq_len, device=k_pos.device)).all(),)
        plan, whole = _fetch_plan(q_last_pos, k_pos, checks)
        if whole and not whole[0]:
            raise ValueError(
                f"k_pos must hold each position 0..{seq_len - 1} once (the whole sequence); for a subset of keys "
                "compose last_query_partial_lse, line_scores and select_lines"
            )
    lse = last_query_partial_lse(q_last, q_last_pos, k, k_pos, scale, plan)
    vertical, slash = line_scores(q_last, q_last_pos, k, k_pos, scale, lse, seq_len, plan)
    if given_k:  # scores follow k's row order; the pattern indexes them by position
        vertical = torch.empty_like(vertical).index_copy_(-1, k_pos, vertical)
    return _select_lines(vertical, slash, config, seq_len, *budgets)


# --------------------------------------------------------------------------- packed documents
def scoring_rows(documents: Documents, row: int, last_q: int) -> tuple[Tensor, Tensor]:
    """(positions, left bounds) int64 CPU [R] of the rows that score the lines of batch row ``row``: the last
    min(last_q, length) positions of every document (a document shorter than ``last_q`` scores with all
    its rows), in ascending order. Positions from ``documents.estimate_end`` on do not score: a document
    that crosses it scores with its last rows before it, one that starts after it with none."""
    end = documents.estimated_len
    starts = documents.starts[min(row, documents.batch - 1)]
    ends = (starts + documents.lengths(min(row, documents.batch - 1))).clamp(max=end)
    starts = starts[starts < end]
    ends = ends[: starts.numel()]
    take = (ends - starts).clamp(max=last_q)
    pos = torch.cat([torch.arange(e - t, e) for e, t in zip(ends.tolist(), take.tolist())])
    return pos, torch.repeat_interleave(starts, take)


@dataclass(frozen=True)
class DocumentRows:
    """The scoring rows of one batch row's documents (``scoring_rows``) against one set of query and key
    positions, as ``document_scores`` reads them: found on the host once per documents, positions and device
    (``document_rows``), so that no layer repeats host work over the positions.

    Attributes:
        seq_len: the packed sequence's length N.
        local: int64 [R] on the device: each scoring row's index in q (any index where q does not hold it).
        held: bool [1, R, 1, 1] on the device: q holds the row.
        pos: int64 [R] on the device: the rows' positions, ascending.
        k_pos: int64 [Sk] on the device: the keys' positions.
        spans: per document: (first row, end row, first key, end key of k_pos in the document, the PositionPlan of
            its rows against those keys, or None without keys).
    """

    seq_len: int
    local: Tensor
    held: Tensor
    pos: Tensor
    k_pos: Tensor
    spans: tuple[tuple[int, int, int, int, PositionPlan | None], ...]


def document_rows(
    documents: Documents,
    row: int,
    last_q: int,
    positions: Callable[[], tuple[Tensor, Tensor]],
    key: Hashable,
    device: torch.device,
) -> DocumentRows:
    """The ``DocumentRows`` of batch row ``row``'s documents against the positions ``key`` names, kept on
    ``documents`` per (row, last_q, key, device). ``positions()`` gives them (q_pos, k_pos: int64 CPU, ascending
    global positions of q's and k's rows), called only to build: host work once per documents, no device sync."""

    def build() -> DocumentRows:
        q_pos, k_pos = positions()
        pos, bound = scoring_rows(documents, row, last_q)
        local = torch.searchsorted(q_pos, pos).clamp(max=q_pos.shape[0] - 1)
        held = (q_pos[local] == pos)[None, :, None, None]
        spans = tuple(_document_spans(pos, bound, k_pos))
        return DocumentRows(
            documents.seq_len, local.to(device), held.to(device), pos.to(device), k_pos.to(device), spans
        )

    return documents.cached(("scoring rows", row, last_q, key, device), build)


def _whole_sequence(seq_len: int) -> Callable[[], tuple[Tensor, Tensor]]:
    """``document_rows``' positions of one device: q and k hold the whole sequence, 0..seq_len-1."""

    def positions() -> tuple[Tensor, Tensor]:
        every = torch.arange(seq_len)
        return every, every

    return positions


def document_scores(
    q: Tensor,
    k: Tensor,
    scale: float,
    rows: DocumentRows,
    share_rows: Callable[[Tensor], Tensor] | None = None,
    share_lse: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """(vertical [B, Hq, Sk] in k's order, slash [B, Hq, N]) scores of q, k ([B, ...]) from the scoring rows
    ``rows`` of one batch row's documents (``document_rows``; B may be > 1 when the rows share boundaries).

    Each document's rows are scored against its own keys only (the keys of k in its position range), one
    document at a time, so the cost is that of one sequence's estimate: rows x keys of each document,
    not of the whole sequence. Under context parallelism ``share_rows`` completes the scoring rows
    (those q does not hold are zero) and ``share_lse`` combines the partial row LSEs over the ranks
    (one call each for all documents); None: q and k hold the whole sequence.
    """
    q_last = torch.where(rows.held, q.index_select(1, rows.local), 0.0)
    if share_rows is not None:
        q_last = share_rows(q_last)
    b, _, hq, _ = q_last.shape
    pos, k_pos = rows.pos, rows.k_pos
    parts = []
    for r0, r1, k0, k1, plan in rows.spans:  # partial LSE of each document's rows over its keys here
        if plan is None:
            parts.append(torch.full((b, hq, r1 - r0), float("-inf"), device=q.device))
        else:
            parts.append(last_query_partial_lse(q_last[:, r0:r1], pos[r0:r1], k[:, k0:k1], k_pos[k0:k1], scale, plan))
    lse = torch.cat(parts, -1)
    if share_lse is not None:
        lse = share_lse(lse)
    n = rows.seq_len
    vertical = torch.zeros(b, hq, k_pos.shape[0], dtype=torch.float32, device=k.device)
    slash = torch.zeros(b * hq, n + 1, dtype=acc_dtype(q_last), device=q.device)
    for r0, r1, k0, k1, plan in rows.spans:
        if plan is not None:
            span = slice(r0, r1)
            v, _ = line_scores(q_last[:, span], pos[span], k[:, k0:k1], k_pos[k0:k1], scale, lse[..., span], n,
                               plan, into=slash)  # fmt: skip
            vertical[..., k0:k1] = v
    return vertical, slash[:, :n].float().view(b, hq, n)


def _document_spans(pos: Tensor, bound: Tensor, k_pos: Tensor) -> list[tuple[int, int, int, int, PositionPlan | None]]:
    """Per document of the scoring rows ``pos`` (ascending, one run per document, ``bound`` its start): (first
    row, end row, first key, end key of k_pos (ascending, distinct) in the document, their PositionPlan or None
    without keys). Keys spanning as many positions as they number are one run: their plan is known from the ends."""
    starts = torch.nonzero(torch.cat([torch.ones(1, dtype=torch.bool), bound[1:] != bound[:-1]])).flatten().tolist()
    spans = []
    for r0, r1 in zip(starts, [*starts[1:], pos.numel()]):
        lo, hi = int(bound[r0]), int(pos[r1 - 1])  # the document's keys the rows see: lo..hi
        k0, k1 = (int(i) for i in torch.searchsorted(k_pos, torch.tensor([lo, hi + 1])))
        plan = None
        if k1 > k0:
            first, last = int(k_pos[k0]), int(k_pos[k1 - 1])
            if last - first == k1 - k0 - 1:
                plan = PositionPlan.contiguous(int(pos[r0]), r1 - r0, first, k1 - k0)
            else:
                plan = PositionPlan.from_positions(pos[r0:r1], k_pos[k0:k1])
        spans.append((r0, r1, k0, k1, plan))
    return spans


def document_sinks(documents: Documents, sink_tokens: int, device: torch.device) -> Tensor:
    """Boolean [B or 1, 1, N]: the first ``sink_tokens`` positions of every document (forced verticals),
    those before ``documents.estimate_end`` only."""
    end = documents.estimated_len

    def build() -> Tensor:  # the sinks found on the host, the mask made on the device
        mask = torch.zeros(documents.batch, 1, documents.seq_len, dtype=torch.bool, device=device)
        for b in range(documents.batch):
            starts = documents.starts[b]
            lengths = ((starts + documents.lengths(b)).clamp(max=end) - starts).clamp(min=0, max=sink_tokens)
            sinks = torch.repeat_interleave(starts, lengths)
            sinks += torch.arange(sinks.numel()) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
            mask[b, 0, sinks.to(device)] = True
        return mask

    return documents.cached(("sinks", sink_tokens, device), build)


def _sinks_and_count(documents: Documents, sink_tokens: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``document_sinks`` and its count per batch row ([B or 1, 1], int64), kept on ``documents``."""
    sinks = document_sinks(documents, sink_tokens, device)
    return sinks, documents.cached(("sink count", sink_tokens, device), lambda: sinks.sum(-1))


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


def _checked_plan(plan: PositionPlan | None, q_pos: Tensor, k_pos: Tensor) -> PositionPlan:
    if plan is None:
        return PositionPlan.from_positions(q_pos, k_pos)
    if not isinstance(plan, PositionPlan) or (plan.rows, plan.keys) != (q_pos.shape[0], k_pos.shape[0]):
        raise ValueError(
            f"plan must be the PositionPlan of these {q_pos.shape[0]} rows and {k_pos.shape[0]} keys; build it "
            "with PositionPlan.from_positions(q_last_pos, k_pos) or pass None"
        )
    return plan


def grouped_queries(q_last: Tensor, kv_heads: int) -> Tensor:
    """[B, R, Hq, D] -> [B, Hkv, group * R, D] (head h uses kv head h // group), for ``grouped_scores``."""
    b, r, hq, d = q_last.shape
    return q_last.transpose(1, 2).reshape(b, kv_heads, (hq // kv_heads) * r, d)


def grouped_scores(q: Tensor, keys: Tensor) -> Tensor:
    """q [B, Hkv, M, D] @ keys [B, Hkv, D, C] in float32 (float64 for float64 inputs), a new tensor
    (``matmul_acc``: on the tensor cores for half-precision inputs on CUDA)."""
    b, h, m, d = q.shape
    c = keys.shape[-1]
    return matmul_acc(q.reshape(b * h, m, d), keys.reshape(b * h, d, c)).view(b, h, m, c)


def _run_keys(k: Tensor, start: int, runs: int, run: int, pad: int) -> Tensor:
    """[B, Hkv, D, runs * (run + pad)]: per run of keys from ``start``, its keys reversed, then ``pad`` zero columns."""
    keys = k[:, start : start + runs * run].unflatten(1, (runs, run)).flip(2)  # [B, runs, run, Hkv, D]
    return F.pad(keys.permute(0, 3, 4, 1, 2), (0, pad)).flatten(-2)


def _diagonal_sums(p: Tensor) -> Tensor:
    """[BH, R, W] -> [BH, W - 1]: column u sums p[:, r, u - r] over rows r (u - r < 0: row r - 1's last columns).

    Viewing the flat buffer with row length W - 1 shifts row r left by r. When p holds runs of keys,
    each reversed and followed by R zero columns (``_run_keys``), the row tails read are zeros and
    column j * (run + R) + u (u < run + R - 1) sums the pairs of run j with r + c = u, c counting keys
    back from the run's last one: one offset, q_0 + u - (position of that last key). The column
    u = run + R - 1 between two runs sums only zeros.
    """
    bh, r, w = p.shape
    return p.view(bh, -1)[:, : r * (w - 1)].view(bh, r, w - 1).sum(1)


def _add_contiguous(slash: Tensor, sums: Tensor, d_lo: int) -> None:
    """slash[:, d_lo + u] += sums[:, u] where d_lo + u >= 0 (negative offsets hold only zeros)."""
    lo = max(d_lo, 0)
    slash[:, lo : d_lo + sums.shape[1]].add_(sums[:, lo - d_lo :])


def _top_lines(
    scores: Tensor, budget: list[int], forced: int | Tensor, threshold: float | None, forced_mask: Tensor | None = None
) -> Tensor:
    """Kept line indices [B, H, max budget], -1 padded: forced lines 0..forced-1 (or those of ``forced_mask``
    [B or 1, 1, N], lowest first while the budget lasts, ``forced`` their count [B or 1, 1]), then by score."""
    b, h, n = scores.shape
    width = max(budget)
    same = min(budget) == width  # every head keeps `width` lines in top-k mode: no padding
    cap = None if same else torch.tensor(budget, device=scores.device)
    step = max(1, _SORT_ELEMENTS // (b * n))
    parts = []
    for lo in range(0, h, step):
        part = scores[:, lo : lo + step]
        key = part.clone()
        if forced_mask is not None:
            key.masked_fill_(forced_mask, float("inf"))
        elif forced:
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
