"""Test inputs shared by the ops and parallel tests: patterns of every shape the kernels must handle, and q/k/v."""

from __future__ import annotations

import torch

from mtraining.ops import Documents, VerticalSlashPattern

PATTERN_KINDS = (
    "causal",  # None: dense causal
    "dense",  # every block diagonal: equal to dense causal
    "random",  # random diagonals and verticals; head 0 has rows that see no key at all
    "random_heads",  # a different density per head, some heads nearly empty or nearly full
    "sinks",  # the first 4 keys only
    "local_sinks",  # two block diagonals, the first 4 keys and one key a third in
    "local_plus_verticals",  # two block diagonals and 10% random verticals
    "local_far",  # `diags` local block diagonals, 4 far ones, `verticals` random verticals and 4 sinks
    "empty_rows",  # one far diagonal and three verticals: many rows see nothing
    "verticals",  # 15% random verticals, no diagonal
    "empty",  # nothing at all
)


def _generator(gen: torch.Generator | int) -> torch.Generator:
    return gen if isinstance(gen, torch.Generator) else torch.Generator().manual_seed(gen)


def make_pattern(
    kind: str,
    b: int,
    h: int,
    n: int,
    g: int,
    gen: torch.Generator | int,
    *,
    diags: int = 8,
    verticals: int = 256,
) -> VerticalSlashPattern | None:
    """A pattern of ``kind`` (``PATTERN_KINDS``) for batch b, h query heads, n tokens on the G = g grid.

    ``gen``: a generator or a seed. ``diags`` and ``verticals`` size the "local_far" kind.
    """
    gen = _generator(gen)
    nb = -(-n // g)
    diag = torch.zeros(b, h, nb, dtype=torch.bool)
    vert = torch.zeros(b, h, n, dtype=torch.bool)
    if kind == "causal":
        return None
    if kind == "dense":
        return VerticalSlashPattern.dense(b, h, n, g)
    if kind == "random":
        diag = torch.rand(b, h, nb, generator=gen) < 0.3
        vert = torch.rand(b, h, n, generator=gen) < 0.08
        diag[:, 0, 0] = False  # head 0: no local block and verticals only late -> early rows see nothing
        vert[:, 0, : n // 2] = False
    elif kind == "random_heads":
        diag = torch.rand(b, h, nb, generator=gen) < torch.rand(b, h, 1, generator=gen)
        vert = torch.rand(b, h, n, generator=gen) < 0.3 * torch.rand(b, h, 1, generator=gen)
    elif kind == "sinks":
        vert[..., :4] = True
    elif kind == "local_sinks":
        diag[..., :2] = True
        vert[..., :4] = True
        vert[..., n // 3] = True
    elif kind == "local_plus_verticals":
        diag[..., :2] = True
        vert[..., torch.randperm(n, generator=gen)[: max(n // 10, 1)]] = True
    elif kind == "local_far":
        diag[..., :diags] = True
        diag.scatter_(-1, torch.randint(diags, nb, (b, h, 4), generator=gen), True)
        vert.scatter_(-1, torch.randint(0, n, (b, h, verticals), generator=gen), True)
        vert[..., :4] = True
    elif kind == "empty_rows":
        diag[..., 2:3] = True
        vert[..., n // 2 : n // 2 + 3] = True
    elif kind == "verticals":
        vert = torch.rand(b, h, n, generator=gen) < 0.15
    elif kind != "empty":
        raise ValueError(f"unknown pattern kind {kind!r}; use one of {PATTERN_KINDS}")
    return VerticalSlashPattern.from_masks(diag, vert, g)


def make_qkv(
    b: int,
    sq: int,
    sk: int,
    hq: int,
    hkv: int,
    d: int,
    dtype: torch.dtype = torch.float64,
    gen: torch.Generator | int = 0,
) -> list[torch.Tensor]:
    """[q [b, sq, hq, d], k, v [b, sk, hkv, d], dout [b, sq, hq, d]]: standard normal (drawn in float64) in ``dtype``."""
    gen = _generator(gen)
    shapes = [(b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, hq, d)]
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]


def striped_positions(n: int, g: int, world: int, rank: int) -> torch.Tensor:
    """Global positions of ``rank``'s shard in the striped layout (stripes of g tokens dealt round-robin)."""
    return torch.arange(n).view(-1, g)[rank::world].flatten()


DOCUMENT_KINDS = (
    "mixed",  # random lengths from 1 token to half the sequence, some shorter than a block
    "short",  # many documents shorter than a block, boundaries anywhere
    "spanning",  # a few short documents, then one that spans the rest (every rank of a ring)
    "quarters",  # four equal documents: in a contiguous layout whole ring steps see no key
)


def make_documents(kind: str, n: int, g: int, gen: torch.Generator | int, batch: int = 1) -> Documents:
    """Packed ``Documents`` of ``kind`` (``DOCUMENT_KINDS``) for sequences of n tokens on the G = g grid,
    one row of boundaries per batch row (drawn independently)."""
    gen = _generator(gen)
    rows = []
    for _ in range(batch):
        if kind == "mixed":
            lengths, left = [], n
            while left > 0:
                size = int(torch.exp(torch.rand(1, generator=gen) * torch.log(torch.tensor(n / 2.0))).item())
                lengths.append(max(1, min(size, left)))
                left -= lengths[-1]
        elif kind == "short":
            lengths, left = [], n
            while left > 0:
                lengths.append(min(int(torch.randint(1, g, (1,), generator=gen)), left))
                left -= lengths[-1]
        elif kind == "spanning":
            head = [int(x) for x in torch.randint(1, g, (3,), generator=gen)]
            lengths = [*head, n - sum(head)]
        elif kind == "quarters":
            lengths = [n // 4] * 3 + [n - 3 * (n // 4)]
        else:
            raise ValueError(f"unknown document kind {kind!r}; use one of {DOCUMENT_KINDS}")
        rows.append(lengths)
    return Documents.from_lengths(rows)
