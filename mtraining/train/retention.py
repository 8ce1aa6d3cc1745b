"""``checkpoint.keep``: after each save, only the newest N checkpoints that verify stay on disk.

A Qwen2.5-3B checkpoint takes about 37 GB (float32 weights and AdamW's two moments: 12 bytes per
parameter), so a run that saves every 25 of 1250 steps would hold 1.9 TB. Rank 0 deletes, after a save
has been committed, every checkpoint older than the newest ``keep`` ones that verify. Verifying here
is the part that costs no reading (``verify_checkpoint(hashes=False)``): the manifest reads and every
file it lists has its recorded size (whatever loads a checkpoint also checks every file's SHA-256 first). A checkpoint that does not
verify is never deleted, nor counted among the kept: it may be one an earlier version wrote, or one to
look at, and it is not a checkpoint to resume from.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from .checkpoint import checkpoints, verify_checkpoint


def prune_checkpoints(root: str | Path, keep: int) -> list[str]:
    """Delete the checkpoints of ``root`` older than its newest ``keep`` that verify (module docstring);
    returns a line per checkpoint deleted or left although old."""
    lines, kept = [], 0
    for path in checkpoints(root):  # newest first
        why = verify_checkpoint(path, hashes=False)
        if why is not None:
            if kept >= keep:
                lines.append(f"checkpoint.keep: left {path} in place: it does not verify ({why})")
            continue
        if kept < keep:
            kept += 1
            continue
        shutil.rmtree(path)
        lines.append(f"checkpoint.keep={keep}: deleted {path}")
    return lines
