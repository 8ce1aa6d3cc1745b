"""tools/tables.py renders every report table from the committed results."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_table_renders_from_the_committed_results():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "tables.py")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "extension_cpu" in proc.stdout and "extension_gpu_base" not in proc.stdout
