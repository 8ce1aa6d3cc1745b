"""The corpus builder: documents from a site-packages-like folder and from prose folders or tar archives, token
files the trainer reads, whole held-out documents as JSONL, a manifest; the same bytes whatever the workers."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from mtraining.cli import app
from mtraining.data.corpus import CorpusOptions, build_corpus, held_out
from mtraining.data.documents import DataError
from mtraining.data.tokenizer import TextTokenizer
from mtraining.data.trees import package_licenses, read_tree

TOKENIZER = Path(__file__).resolve().parents[2] / "data" / "tokenizer.json"
SEP = 0  # <|endoftext|> of the shipped tokenizer, its separator


def _write(root: Path, files: dict[str, bytes | str]) -> Path:
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return root


@pytest.fixture
def site(tmp_path) -> Path:
    """A site-packages folder: two packages, a module, metadata, a test folder, a binary, a duplicate, an empty file."""
    return _write(
        tmp_path / "site-packages",
        {
            "alpha/__init__.py": 'TOKEN = "<|endoftext|>"\n',
            "alpha/core/b.py": "def b():\n    return 2\n",
            "alpha/core/a.py": "def a():\n    return 1\n",
            "alpha/tests/test_a.py": "def test_a():\n    assert True\n",
            "alpha/__pycache__/a.cpython-311.py": "cached",
            "alpha/data.bin.py": b"\x00\x01\x02",
            "alpha/empty.py": "\n",
            "beta/copy.py": "def b():\n    return 2\n",
            "beta/own.py": "import alpha\n",
            "gamma.py": "print('gamma')\n",
            "alpha-1.0.dist-info/METADATA": "Name: alpha\nVersion: 1.0\nLicense-Expression: MIT\n",
            "alpha-1.0.dist-info/top_level.txt": "alpha\n",
            "beta-2.0.dist-info/METADATA": "Name: beta\nVersion: 2.0\nClassifier: License :: OSI Approved :: BSD License\n",
            "beta-2.0.dist-info/RECORD": "beta/own.py,,\nbeta/copy.py,,\n",
        },
    )


@pytest.fixture
def books(tmp_path) -> Path:
    return _write(
        tmp_path / "books",
        {
            "LICENSE.txt": "Free Text License 1.0\nredistribute freely\n",
            "guide/part2.rst": "Second part of the guide.\n",
            "guide/part1.txt": "First part. The river ran north.\n",
            "essay.txt": "An essay on boats and tides.\n",
            "guide/figure.png": b"\x89PNG",
        },
    )


def _decode(ids) -> str:
    return TextTokenizer(TOKENIZER).hf.decode(list(ids))


def _documents(ids: np.ndarray) -> list[str]:
    """The texts between separator ids (each document ends with one)."""
    ends = np.flatnonzero(ids == SEP)
    assert ends[-1] == len(ids) - 1
    return [_decode(ids[start + 1 : end]) for start, end in zip([-1, *ends[:-1]], ends)]


def _build(out: Path, trees, workers: int = 1, **options) -> dict:
    options = CorpusOptions(**{"heldout_fraction": 0.0, **options})
    return build_corpus(out, TOKENIZER, trees, options, workers, "test", log=lambda line: None)


def test_one_document_per_package_in_path_order_with_headers(tmp_path, site):
    manifest = _build(tmp_path / "out", [("code", site)])
    docs = {d["name"]: d for d in manifest["documents"]}
    assert list(docs) == ["code/alpha", "code/beta", "code/gamma"]
    ids = np.load(tmp_path / "out" / "train" / "code.npy")
    assert ids.dtype == np.uint16
    assert _documents(ids) == [
        '# alpha/__init__.py\nTOKEN = "<|endoftext|>"\n\n# alpha/core/a.py\ndef a():\n    return 1\n\n'
        "# alpha/core/b.py\ndef b():\n    return 2\n\n# alpha/tests/test_a.py\ndef test_a():\n    assert True\n",
        "# beta/own.py\nimport alpha\n",  # beta/copy.py has alpha/core/b.py's bytes: dropped
        "# gamma.py\nprint('gamma')\n",
    ]
    # the special token's text inside a file is plain text: separators only end documents
    ends = np.flatnonzero(ids == SEP)
    assert ends.tolist() == (np.cumsum([docs[n]["tokens"] + 1 for n in docs]) - 1).tolist()
    assert docs["code/alpha"]["license"] == "alpha 1.0: MIT" and docs["code/beta"]["license"] == "beta 2.0: BSD License"
    assert manifest["trees"][0]["skipped"] == {
        "files in metadata folders": 1,
        "binary or not UTF-8": 1,
        "empty": 1,
        "duplicate files": 1,
    }
    assert manifest["tokenizer"]["separator"] == "<|endoftext|>" and manifest["totals"]["heldout_documents"] == 0


def test_skip_tests_min_tokens_and_file_size(tmp_path, site):
    manifest = _build(tmp_path / "out", [("code", site)], skip_tests=True, min_tokens=23, max_file_bytes=22)
    docs = {d["name"]: d for d in manifest["documents"]}
    assert docs["code/alpha"]["files"] == 2  # __init__.py (24 bytes) and the tests are left out
    assert docs["code/gamma"]["split"] == "dropped (under min_tokens)"  # 22 tokens; beta has 23
    skipped = manifest["trees"][0]["skipped"]
    assert skipped["files in test folders"] == 1 and skipped["files over max_file_bytes"] == 1
    text = _decode(np.load(tmp_path / "out" / "train" / "code.npy"))
    assert "test_a" not in text and "gamma" not in text and "TOKEN" not in text


def test_prose_from_a_folder_or_a_tar_archive_is_the_same(tmp_path, books):
    archive = tmp_path / "books.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        for path in sorted(books.rglob("*"), reverse=True):  # member order does not matter
            if path.is_file():
                data = path.read_bytes()
                info = tarfile.TarInfo("./" + path.relative_to(books).as_posix())
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    from_folder = _build(tmp_path / "a", [("prose", books)])
    from_archive = _build(tmp_path / "b", [("prose", archive)])
    assert (tmp_path / "a/train/prose.npy").read_bytes() == (tmp_path / "b/train/prose.npy").read_bytes()
    assert [d["name"] for d in from_folder["documents"]] == ["prose/essay.txt", "prose/guide"]
    assert _documents(np.load(tmp_path / "a/train/prose.npy"))[1] == (
        "# guide/part1.txt\nFirst part. The river ran north.\n\n# guide/part2.rst\nSecond part of the guide.\n"
    )
    for manifest in (from_folder, from_archive):
        assert manifest["trees"][0]["license_files"] == {"LICENSE.txt": "Free Text License 1.0"}


def test_held_out_documents_are_whole_and_stable(tmp_path, site, books):
    trees = [("code", site), ("prose", books)]
    manifest = _build(tmp_path / "out", trees, heldout_fraction=0.5, seed=3, heldout=("prose/guide",))
    split = {d["name"]: d["split"] for d in manifest["documents"]}
    expected = {name: "heldout" if held_out(name, 3, 0.5) else "train" for name in split}
    assert split == {**expected, "prose/guide": "heldout"}
    assert "heldout" in split.values() and "train" in split.values()
    records = [
        json.loads(line) for kind in ("code", "prose") for line in (tmp_path / "out/heldout" / f"{kind}.jsonl").open()
    ]
    assert sorted(r["name"] for r in records) == sorted(n for n, s in split.items() if s == "heldout")
    tok = TextTokenizer(TOKENIZER)  # reads "<|endoftext|>" inside a file as text, as the builder does
    for record in records:
        assert record["tokens"] == len(tok.encode(record["text"]))
    guide = next(r for r in records if r["name"] == "prose/guide")
    assert guide["text"].startswith("# guide/part1.txt\n") and guide["source"] == str(books)
    train_text = _decode(np.load(tmp_path / "out/train/prose.npy"))
    assert "river" not in train_text  # a held-out document is nowhere in the training tokens
    # the split of a name depends on the seed and the name alone
    assert [held_out(f"code/p{i}", 0, 0.3) for i in range(200)].count(True) in range(40, 81)
    assert not any(held_out(f"code/p{i}", 0, 0.0) for i in range(50)) and all(held_out("x", s, 1.0) for s in range(9))
    ranged = _build(tmp_path / "ranged", trees, heldout_fraction=1.0, heldout_min_tokens=30, heldout_max_tokens=120)
    for d in ranged["documents"]:
        assert d["split"] == ("heldout" if 30 <= d["tokens"] <= 120 else "train"), d
    assert {d["split"] for d in ranged["documents"]} == {"heldout", "train"}


def test_the_same_inputs_give_the_same_bytes_whatever_the_workers(tmp_path, site, books, monkeypatch):
    from mtraining.data import corpus

    monkeypatch.setattr(corpus, "PIECE_BYTES", 40)  # several pieces per document
    trees = [("code", site), ("prose", books)]
    one = _build(tmp_path / "one", trees, workers=1, heldout_fraction=0.5)
    two = _build(tmp_path / "two", trees, workers=3, heldout_fraction=0.5)
    files = sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*") if p.is_file())
    assert [str(f) for f in files] == [
        "heldout/code.jsonl",
        "heldout/prose.jsonl",
        "manifest.json",
        "train/code.npy",
        "train/prose.npy",
    ]
    for f in files:
        assert (tmp_path / "one" / f).read_bytes() == (tmp_path / "two" / f).read_bytes(), f
    assert one == two


def test_bad_input_names_the_fix(tmp_path, site):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    (tmp_path / "nothing").mkdir()
    for args, options, message in (
        (("full", [("code", site)]), {}, "exists and is not an empty folder"),
        (("o", [("code", tmp_path / "missing")]), {}, "does not exist"),
        (("o", [("code", tmp_path / "nothing")]), {}, "hold no documents"),
        (("o", [("images", site)]), {}, "tree kind 'images'"),
        (("o", [("code", site)]), {"heldout_fraction": 1.5}, r"must lie in \[0, 1\]"),
        (("o", [("code", site)]), {"heldout": ("code/delta",)}, r"\['code/delta'\] are not in the corpus"),
    ):
        with pytest.raises(DataError, match=message):
            _build(tmp_path / args[0], args[1], **options)
    assert not (tmp_path / "o").exists()


def test_a_file_that_cannot_be_read_is_skipped(tmp_path):
    from mtraining.data.corpus import _scan
    from mtraining.data.trees import TreeDocument, TreeFile

    doc = TreeDocument("code/x", "code", str(tmp_path), [TreeFile("x/a.py", disk=str(tmp_path))])  # a folder
    assert _scan(doc) == [("unreadable", "")]


def test_package_licenses_and_trees_read_metadata(site):
    assert package_licenses(site) == {"alpha": "alpha 1.0: MIT", "beta": "beta 2.0: BSD License"}
    tree = read_tree(site, "code", (".py",))
    assert [f.path for f in tree.documents[0].files][:3] == ["alpha/__init__.py", "alpha/core/a.py", "alpha/core/b.py"]


def test_the_command_builds_a_corpus_the_trainer_reads(tmp_path, site, books):
    from mtraining.data.tokens import open_token_file

    out = tmp_path / "corpus"
    args = ["corpus", str(out), "--tokenizer", str(TOKENIZER), "--code", str(site), "--prose", str(books)]
    run = CliRunner().invoke(app, [*args, "--workers", "2", "--heldout", "code/beta"])
    assert run.exit_code == 0, run.output
    totals = json.loads(run.stdout)  # progress goes to stderr
    assert totals["documents"] == 5 and totals["heldout_documents"] == 1
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["command"].startswith("mtraining ")  # the command line as typed (here pytest's arguments)
    assert len(open_token_file(out / "train" / "code.npy")) == totals["train_tokens"]["code"] + 2  # + separators
    run = CliRunner().invoke(app, ["corpus", str(tmp_path / "x"), "--tokenizer", str(TOKENIZER)])
    assert run.exit_code == 2 and "give at least one --code, --python or --prose source" in run.output
