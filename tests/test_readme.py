"""README's "Use the attention directly" snippet imports what it uses, as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_use_the_attention_directly_imports_work():
    text = README.read_text()
    section = text[text.index("## Use the attention directly") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    imports = "\n".join(line for line in code.splitlines() if line.startswith(("from ", "import ")))
    assert imports, "the snippet imports nothing"
    names: dict = {}
    exec(imports, names)
    for used in ("estimate_pattern", "PatternConfig", "sparse_attention", "make_layout", "ring_attention"):
        assert used in code and callable(names[used]), used
