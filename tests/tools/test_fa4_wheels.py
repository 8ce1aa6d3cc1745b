"""tools/carry_parts.py and tools/fa4_wheels.sh: wheels laid out over several device calls (a file over the budget
split in parts), then, sourced in each call, stashed, joined, checked against SHA256 and installed once all have
come; a file that does not match is not installed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "fa4_wheels.sh"
sys.path.insert(0, str(ROOT / "tools"))
import carry_parts  # noqa: E402


def wheel(path: Path, package: str, payload: int = 0) -> Path:
    """A minimal installable wheel of one package, with ``payload`` random bytes in it (they do not compress)."""
    info = f"{package}-0.0.dist-info"
    files: dict[str, str | bytes] = {
        f"{package}/__init__.py": "",
        f"{package}/payload.bin": os.urandom(payload),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def call(repo: Path, carried: list[Path], tmp: Path) -> subprocess.CompletedProcess:
    """One device call: ``carried`` in the checkout's .fa4/, the script sourced; prints FA4_READY and PYTHONPATH."""
    shutil.rmtree(repo / ".fa4", ignore_errors=True)
    (repo / ".fa4").mkdir(parents=True)
    for f in carried:
        shutil.copy(f, repo / ".fa4" / f.name)
    python = Path(shutil.which("python3") or sys.executable).parent  # the environment's pip, as a device call's
    env = {"FA4_STASH": str(tmp / "stash"), "FA4_SITE": str(tmp / "site"), "PATH": f"{python}:/usr/bin:/bin"}
    script = f'source {SCRIPT}; echo "ready=$FA4_READY path=$PYTHONPATH"'
    return subprocess.run(["bash", "-c", script], cwd=repo, env=env, capture_output=True, text=True, timeout=120)


def carried_set(tmp: Path) -> list[list[Path]]:
    """The calls' files as tools/carry_parts.py lays them out: flash_attn's wheel over the budget (split in two
    parts), another wheel whole, and SHA256 in each call."""
    src = tmp / "src"
    src.mkdir()
    big = wheel(src / "flash_attn-0.0-py3-none-any.whl", "flash_attn", payload=20_000)
    small = wheel(src / "extra_dep-0.0-py3-none-any.whl", "extra_dep")
    budget = (big.stat().st_size // 2 + 1) / carry_parts.MB
    folders = carry_parts.lay_out([big, small], budget, tmp / "calls")
    return [sorted(folder.iterdir()) for folder in folders]


def test_parts_over_the_calls_install_once_all_have_come(tmp_path):
    calls = carried_set(tmp_path)
    assert [sorted(f.name for f in call) for call in calls] == [
        ["SHA256", "flash_attn-0.0-py3-none-any.whl.part00"],
        ["SHA256", "flash_attn-0.0-py3-none-any.whl.part01"],
        ["SHA256", "extra_dep-0.0-py3-none-any.whl"],
    ]
    repo = tmp_path / "repo"
    for carried in calls[:-1]:
        done = call(repo, carried, tmp_path)
        assert "still to carry:" in done.stdout and "ready= " in done.stdout
    done = call(repo, calls[-1], tmp_path)
    assert "ready=1" in done.stdout, done.stdout + done.stderr
    assert f"path={tmp_path / 'site'}:" in done.stdout
    assert (tmp_path / "site" / "flash_attn" / "__init__.py").exists()
    assert (tmp_path / "site" / "extra_dep" / "__init__.py").exists()


def test_a_part_that_does_not_match_is_not_installed(tmp_path):
    *firsts, last = carried_set(tmp_path)
    part = next(f for f in firsts[-1] if f.name != "SHA256")
    part.write_bytes(part.read_bytes() + b"x")
    repo = tmp_path / "repo"
    for carried in firsts:
        call(repo, carried, tmp_path)
    done = call(repo, last, tmp_path)
    assert "do not match .fa4/SHA256" in done.stdout and "ready= " in done.stdout
    assert not (tmp_path / "site" / "flash_attn").exists()
