"""Compare the sm_90 PTX of every kernel between two dumps of tools/compile_kernels_sm90.py: no GPU needed.

Two commits whose kernels compile to the same PTX, once stripped of what does not reach the machine
code (``.loc``/``.file`` lines, debug sections and their labels, comments, spacing, the kernel's name, which
also names its parameters), run the same instructions: a refactoring that keeps the PTX keeps the
speed, with one caveat that ``--ptxas`` settles: ptxas also sees the debug labels that mark the
scopes of inlined ``@triton.jit`` calls (``$L__tmp``), and a new helper function can move them and
change the SASS (scheduling, registers, spill slots) though every PTX instruction is the same. With
``--ptxas`` each side is assembled as Triton assembles it, by its bundled ``ptxas`` for sm_90a
(registers, spills, stack), disassembled (``cuobjdump -sass``), and the SASS instruction streams
(without addresses and encodings) are compared too. ``--params-by-use`` compares the PTX up to where
parameters are loaded and how registers are numbered (``params_by_use``), so a kernel whose arguments are
only regrouped or reordered compares equal; its SASS may still differ, since ptxas schedules around the
moved loads (the records count the opcodes that change), and the SASS constant-bank addresses are named by
first use. Each record counts the instructions on both sides
(PTX and, with ``--ptxas``, SASS): what a change that must alter the code adds. Exit status 1 when any kernel differs, in its
PTX or, with ``--ptxas``, its SASS (or is missing on one side).

    TRITON_CACHE_DIR=$(mktemp -d) PYTHONPATH=<old worktree> python tools/compile_kernels_sm90.py --ptx-dir /tmp/ptx/old
    TRITON_CACHE_DIR=$(mktemp -d) PYTHONPATH=. python tools/compile_kernels_sm90.py --ptx-dir /tmp/ptx/new
    python -m tools.ptx_compare /tmp/ptx/old /tmp/ptx/new --ptxas --out bench/results/ptx_compare.json
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from bench.common import provenance, write_results

ENTRY = re.compile(r"^\.visible \.entry (\w+)\(", re.MULTILINE)
DEBUG_LABEL = re.compile(r"^\$L__(tmp|func_begin|func_end)\d+:$")
PTXAS_STATS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "stack_frame": re.compile(r"(\d+) bytes stack frame"),
}
SASS_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
LD_PARAM = re.compile(r"^ld\.param\.(\w+) (%\w+), \[KERNEL_param_(\d+)(\+\d+)?\];$")
REGISTER = re.compile(r"%[a-z]+\d+")
COMMUTATIVE = re.compile(r"^((?:mul\.lo|add)\.[su](?:32|64)) (%[\w.]+), (%[\w.]+), (%[\w.]+);$")
DECLARATION = re.compile(r"^\.param .*KERNEL_param_\d+")
PARAM_REF = re.compile(r"\bKERNEL_param_(\d+)\b")
CONSTANT = re.compile(r"c\[0x0\]\[(0x[0-9a-f]+)\]")


def normalise_ptx(ptx: str) -> list[str]:
    """The lines of ``ptx`` that reach the machine code, with the kernel's name replaced by ``KERNEL``."""
    names = ENTRY.findall(ptx)
    lines = []
    for line in ptx.splitlines():
        if line.lstrip().startswith(".section") and ".debug" in line:
            break  # the debug sections close the module
        line = " ".join(line.split("//", 1)[0].split())
        if not line or line.startswith((".loc", ".file")) or DEBUG_LABEL.match(line):
            continue
        for name in names:
            line = re.sub(rf"\b{name}(?=\b|_param_)", "KERNEL", line)
        lines.append(line)
    return lines


def params_by_use(lines: list[str]) -> list[str]:
    """Normalised PTX of a kernel whose arguments may come in another order (say, regrouped into tuples).

    Where a parameter is loaded follows the argument order, and with it the numbering of every register, so:
    the parameter loads are set apart, a register loaded from a parameter is named by that parameter (in
    order of first use, with its type), every other register by first use, and the two operands of a
    commutative integer multiply or add are sorted (their order follows value numbering). Two kernels equal
    under it run the same instructions on the same values; the declarations (the parameters' number and
    layout) are left out.
    """
    loaded: dict[str, tuple[str, str]] = {}
    body = []
    for line in lines[lines.index("{") :]:
        if m := LD_PARAM.match(line):
            loaded[m.group(2)] = (m.group(3) + (m.group(4) or ""), m.group(1))
        else:
            body.append(line)
    params: dict[str, str] = {}
    registers: dict[str, str] = {}

    def rename(match: re.Match) -> str:
        reg = match.group(0)
        if reg in loaded:
            param, kind = loaded[reg]
            return params.setdefault(param, f"%P{len(params)}.{kind}")
        return registers.setdefault(reg, f"%v{len(registers)}")

    def refer(match: re.Match) -> str:  # a parameter's address (a tensor descriptor's)
        return params.setdefault(match.group(1), f"%P{len(params)}.address")

    out = []
    for line in body:
        line = PARAM_REF.sub(refer, REGISTER.sub(rename, line))
        if m := COMMUTATIVE.match(line):
            line = f"{m.group(1)} {m.group(2)}, {', '.join(sorted((m.group(3), m.group(4))))};"
        out.append(line)
    return out


def constants_by_use(sass: list[str]) -> list[str]:
    """SASS with the constant-bank addresses (where the parameters live) named in order of first use."""
    seen: dict[str, str] = {}
    return [CONSTANT.sub(lambda m: f"c[0x0][K{seen.setdefault(m.group(1), str(len(seen)))}]", line) for line in sass]


def opcode_changes(old: list[str], new: list[str]) -> dict[str, int]:
    """How many more (or fewer) of each SASS opcode ``new`` runs than ``old``."""
    counts = [Counter(line.split()[1 if line.startswith("@") else 0].split(".")[0] for line in s) for s in (old, new)]
    return {op: counts[1][op] - counts[0][op] for op in sorted(counts[0] | counts[1]) if counts[1][op] != counts[0][op]}


def ptx_instructions(lines: list[str]) -> int:
    """How many of the normalised lines are instructions (not directives, declarations, labels or braces)."""
    return sum(1 for line in lines if line.endswith(";") and not line.startswith("."))


def diff_lines(old: list[str], new: list[str], context: int = 2) -> list[str]:
    """Unified diff of two normalised listings (empty when they are equal)."""
    return list(difflib.unified_diff(old, new, "old", "new", n=context, lineterm=""))


def changed_lines(diff: list[str]) -> int:
    """Lines removed plus lines added in a unified diff."""
    return sum(1 for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---")))


def _nvidia_bin(tool: str) -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool


def assemble(ptx_path: Path, work: Path) -> tuple[dict, list[str]]:
    """ptxas -v statistics for sm_90a and the SASS instructions (name-free) of one PTX file."""
    cubin = work / (ptx_path.stem + ".cubin")
    result = subprocess.run(
        [str(_nvidia_bin("ptxas")), "-v", "--gpu-name", "sm_90a", str(ptx_path), "-o", str(cubin)],
        capture_output=True,
        text=True,
        check=True,
    )
    stats = {key: int(m.group(1)) if (m := rx.search(result.stderr)) else 0 for key, rx in PTXAS_STATS.items()}
    sass = subprocess.run(
        [str(_nvidia_bin("cuobjdump")), "-sass", str(cubin)], capture_output=True, text=True, check=True
    ).stdout
    return stats, [m.group(1) for line in sass.splitlines() if (m := SASS_INSTRUCTION.match(line))]


def compare(old_dir: Path, new_dir: Path, ptxas: bool = False, show: int = 40, by_use: bool = False) -> list[dict]:
    """One record per kernel label found in either dump; ``by_use``: parameters (PTX) and constant-bank
    addresses (SASS) compared by order of first use (``params_by_use``)."""
    labels = sorted({p.stem for p in old_dir.glob("*.ptx")} | {p.stem for p in new_dir.glob("*.ptx")})
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for label in labels:
            old_path, new_path = old_dir / f"{label}.ptx", new_dir / f"{label}.ptx"
            if not (old_path.exists() and new_path.exists()):
                missing = "old" if not old_path.exists() else "new"
                records.append(dict(kernel=label, identical=False, missing=missing))
                continue
            old_ptx, new_ptx = normalise_ptx(old_path.read_text()), normalise_ptx(new_path.read_text())
            canonical = params_by_use if by_use else list
            diff = diff_lines(canonical(old_ptx), canonical(new_ptx))
            record = dict(
                kernel=label,
                identical=not diff,
                lines_changed=changed_lines(diff),
                ptx_instructions_old=ptx_instructions(old_ptx),
                ptx_instructions=ptx_instructions(new_ptx),
                parameters_old=sum(1 for line in old_ptx if DECLARATION.match(line)),
                parameters=sum(1 for line in new_ptx if DECLARATION.match(line)),
                diff=diff[:show],
            )
            if ptxas:
                old_dir_tmp, new_dir_tmp = Path(tmp, "old"), Path(tmp, "new")
                old_dir_tmp.mkdir(exist_ok=True)
                new_dir_tmp.mkdir(exist_ok=True)
                old_stats, old_sass = assemble(old_path, old_dir_tmp)
                new_stats, new_sass = assemble(new_path, new_dir_tmp)
                if by_use:
                    old_sass, new_sass = constants_by_use(old_sass), constants_by_use(new_sass)
                sass_diff = diff_lines(old_sass, new_sass)
                record.update(
                    ptxas_old=old_stats,
                    ptxas_new=new_stats,
                    sass_instructions_old=len(old_sass),
                    sass_instructions=len(new_sass),
                    sass_identical=not sass_diff,
                    sass_lines_changed=changed_lines(sass_diff),
                    sass_diff=sass_diff[:show],
                    sass_opcode_changes=opcode_changes(old_sass, new_sass),
                )
            records.append(record)
    return records


def _source(ptx_dir: Path) -> dict:
    path = ptx_dir / "source.json"
    return json.loads(path.read_text()) if path.exists() else {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path, help="PTX dump of the reference commit")
    parser.add_argument("new", type=Path, help="PTX dump of the commit under test")
    parser.add_argument("--ptxas", action="store_true", help="also assemble both sides: registers, spills, SASS")
    parser.add_argument(
        "--params-by-use",
        action="store_true",
        help="compare PTX up to where parameters are loaded (params_by_use): arguments reordered compare equal",
    )
    parser.add_argument("--out", type=Path, help="write the records as JSON (e.g. bench/results/ptx_compare.json)")
    parser.add_argument(
        "--why", action="append", default=[], metavar="KERNEL=TEXT", help="record why a kernel differs (repeatable)"
    )
    args = parser.parse_args()
    records = compare(args.old, args.new, ptxas=args.ptxas, by_use=args.params_by_use)
    why = dict(note.split("=", 1) for note in args.why)
    for r in records:
        if r["kernel"] in why:
            r["why"] = why[r["kernel"]]
    for r in records:
        status = (
            "identical" if r["identical"] else f"DIFFERS ({r.get('lines_changed', 'missing ' + r.get('missing', ''))})"
        )
        extra = ""
        if "ptx_instructions" in r:
            extra = f"; PTX instructions {r['ptx_instructions_old']} -> {r['ptx_instructions']}"
        if "ptxas_new" in r:
            o, n = r["ptxas_old"], r["ptxas_new"]
            sass = "same SASS" if r["sass_identical"] else f"SASS differs ({r['sass_lines_changed']} lines)"
            extra += (
                f"; registers {o['registers']} -> {n['registers']}, spills {o['spill_stores']} -> {n['spill_stores']} B"
                f"; {sass}, {r['sass_instructions_old']} -> {r['sass_instructions']} instructions"
            )
        print(f"{r['kernel']}: {status}{extra}")
    if args.out:
        header = dict(
            provenance(on_gpu=False),
            device="cpu (no GPU): PTX for sm_90 from tools/compile_kernels_sm90.py",
            params_by_use=args.params_by_use,
            old=_source(args.old),
            new=_source(args.new),
        )
        if args.ptxas:
            version = subprocess.run([str(_nvidia_bin("ptxas")), "--version"], capture_output=True, text=True)
            header["ptxas"] = version.stdout.strip().splitlines()[-2]
        print(f"wrote {write_results('ptx_compare', [dict(header, kernels=records)], args.out)}")
    return 0 if all(r["identical"] and r.get("sass_identical", True) for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
