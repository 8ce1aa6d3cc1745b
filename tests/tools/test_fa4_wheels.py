"""tools/fa4_wheels.sh, sourced in device calls: wheels carried in parts over several calls are stashed, joined,
checked against SHA256 and installed once all have come; a file that does not match is not installed."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "fa4_wheels.sh"


def wheel(path: Path, package: str) -> Path:
    """A minimal installable wheel of one empty package."""
    info = f"{package}-0.0.dist-info"
    files = {
        f"{package}/__init__.py": "",
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


def carried_set(tmp: Path) -> tuple[list[Path], list[Path]]:
    """Two calls' files: flash_attn's wheel split in two parts, another wheel whole, SHA256 of parts and wholes."""
    src = tmp / "src"
    src.mkdir()
    big = wheel(src / "flash_attn-0.0-py3-none-any.whl", "flash_attn")
    small = wheel(src / "extra_dep-0.0-py3-none-any.whl", "extra_dep")
    data = big.read_bytes()
    parts = [src / f"{big.name}.part00", src / f"{big.name}.part01"]
    parts[0].write_bytes(data[: len(data) // 2])
    parts[1].write_bytes(data[len(data) // 2 :])
    lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n" for p in (*parts, small, big)]
    (src / "SHA256").write_text("".join(lines))
    return [parts[0], src / "SHA256"], [parts[1], small, src / "SHA256"]


def test_parts_over_two_calls_install_once_all_have_come(tmp_path):
    first, second = carried_set(tmp_path)
    repo = tmp_path / "repo"
    done = call(repo, first, tmp_path)
    assert "still to carry: flash_attn-0.0-py3-none-any.whl.part01 extra_dep-0.0-py3-none-any.whl" in done.stdout
    assert "ready= " in done.stdout
    done = call(repo, second, tmp_path)
    assert "ready=1" in done.stdout, done.stdout + done.stderr
    assert f"path={tmp_path / 'site'}:" in done.stdout
    assert (tmp_path / "site" / "flash_attn" / "__init__.py").exists()
    assert (tmp_path / "site" / "extra_dep" / "__init__.py").exists()


def test_a_part_that_does_not_match_is_not_installed(tmp_path):
    first, second = carried_set(tmp_path)
    second[0].write_bytes(second[0].read_bytes() + b"x")
    repo = tmp_path / "repo"
    call(repo, first, tmp_path)
    done = call(repo, second, tmp_path)
    assert "do not match .fa4/SHA256" in done.stdout and "ready= " in done.stdout
    assert not (tmp_path / "site" / "flash_attn").exists()
