"""Pack the text sources of a Debian documentation package into one small archive for `mtraining corpus --prose`.

The reStructuredText sources Sphinx keeps beside its HTML (``_sources/**/*.txt``) are long English prose,
one folder per book. This unpacks the .deb (``dpkg-deb -x``), takes that folder and the package's
copyright file, and writes a .tar.xz with the books at its top level and ``LICENSE.txt`` (a line naming
the package and its license, then the copyright file). Members are sorted, with fixed owners and times,
so the same package gives the same archive byte for byte.

    apt-get download python3.11-doc      # Debian 12: python3.11-doc_3.11.2-6+deb12u8_all.deb, PSF License
    python tools/prose_archive.py python3.11-doc_*.deb /work/scratch/python-3.11-docs.tar.xz
"""

from __future__ import annotations

import argparse
import io
import lzma
import subprocess
import tarfile
import tempfile
from pathlib import Path

SOURCES = "usr/share/doc/python3.11/html/_sources"
COPYRIGHT = "usr/share/doc/python3.11-doc/copyright"
NOTE = (
    "Python 3.11 documentation sources (reStructuredText, the _sources folder of the HTML build) from the Debian "
    "package {deb}; license: PSF License Agreement for Python (Version 2) and the other notices below, from the "
    "package's copyright file.\n\n"
)


def _add(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uname, info.gname = len(data), 0, 0o644, "", ""
    archive.addfile(info, io.BytesIO(data))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("deb", type=Path)
    parser.add_argument("out", type=Path, help="the .tar.xz to write")
    parser.add_argument("--sources", default=SOURCES, help="the folder of text sources inside the package")
    parser.add_argument("--copyright", default=COPYRIGHT, help="the package's copyright file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["dpkg-deb", "-x", str(args.deb), tmp], check=True)
        root = Path(tmp) / args.sources
        files = sorted(p for p in root.rglob("*") if p.is_file())
        license_text = NOTE.format(deb=args.deb.name) + (Path(tmp) / args.copyright).read_text()
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
            _add(archive, "LICENSE.txt", license_text.encode())
            for path in files:
                _add(archive, path.relative_to(root).as_posix(), path.read_bytes())
    args.out.write_bytes(lzma.compress(buffer.getvalue(), preset=9 | lzma.PRESET_EXTREME))
    print(f"{args.out}: {len(files)} files, {buffer.tell():,} bytes, {args.out.stat().st_size:,} compressed")


if __name__ == "__main__":
    main()
