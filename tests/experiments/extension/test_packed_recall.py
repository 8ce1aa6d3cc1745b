"""experiments/extension/packed_recall.py: packed samples, scoring per document position, and the whole run at toy size."""

from __future__ import annotations

import json

import pytest
import torch

from experiments.extension import packed_recall as pr
from experiments.extension import report

pytestmark = pytest.mark.slow

TOY = pr.SCALES["toy"]


def test_packed_samples_hold_each_document_and_its_answers():
    samples = pr.packed_samples(TOY, 2, seed=0)
    vocab = TOY.vocab
    for sample in samples:
        assert len(sample.ids) == TOY.long and sample.lengths == [TOY.l0] * TOY.factor
        for k, answers in enumerate(sample.answers):
            start = k * TOY.l0
            assert sample.ids[start] == vocab.eos_id and len(answers) == len(TOY.depths)
            for p in answers:
                assert start < p < start + TOY.l0 and sample.ids[p - 2] == vocab.query_id
                stated = [i for i in range(start, p - 2) if sample.ids[i] == sample.ids[p - 1]]
                assert len(stated) == 1 and sample.ids[stated[0] + 1] == sample.ids[p]  # the needle, in its document
    assert samples[0].ids != samples[1].ids


class Stand:
    """An engine stand-in: right except at ``wrong`` positions of its first call; keeps the documents each call
    passed."""

    def __init__(self, wrong: set[int]) -> None:
        self.wrong, self.documents, self.row_recall = wrong, [], []

    def token_scores(self, ids, documents=None):
        self.documents.append(documents)
        predicted = ids[1:].clone()
        for p in self.wrong if len(self.documents) == 1 else ():
            predicted[p - 1] = -1
        return torch.zeros(len(ids) - 1), predicted  # no row_recall: scored as dense


@pytest.mark.parametrize("masked", [False, True])
def test_score_counts_each_answer_at_its_document_position(masked):
    samples = pr.packed_samples(TOY, 2, seed=0)
    wrong = {samples[0].answers[1][0], samples[0].answers[3][1]}  # sample 0: one miss in documents 2 and 4
    engine = Stand(wrong)
    records = pr.score(engine, samples, masked)
    q = len(TOY.depths)
    assert [[d["hits"] for d in docs] for docs in records] == [[q, q], [q - 1, q], [q, q], [q - 1, q]]
    assert all(d["answers"] == q and "answer_recall" not in d for docs in records for d in docs)
    if masked:
        assert [d.lengths().tolist() for d in engine.documents] == [[TOY.l0] * TOY.factor] * 2
    else:
        assert engine.documents == [None, None]


def test_run_at_toy_size(tmp_path):
    """The whole run (toy base trained, 2 samples): every figure in the JSON is recomputed from its records."""
    result = pr.run(TOY, tmp_path / "work", tmp_path / "out", samples=2, seed=0, masked_budgets=("v10",))
    assert json.loads((tmp_path / "out" / "packed_recall.json").read_text()) == json.loads(json.dumps(result))
    assert {"device", "commit", "command"} <= result.keys() and result["device"] == "cpu"
    assert result["pattern"] == pr.Budget(**result["budget"]).pattern(TOY.long, TOY)
    assert result["rope_theta"] == TOY.base_theta and result["documents_per_sample"] == TOY.factor
    assert list(result["conditions"]) == [*pr.CONDITIONS, "sparse_masked_v10"]
    for name, c in result["conditions"].items():
        sparse, masked = pr.CONDITIONS.get(name, (True, True))
        assert (c["attention"] == "sparse") == sparse and c["document_masking"] == masked
        assert c["pattern"] == (TOY.budget(c["budget"]).pattern(TOY.long, TOY) if sparse else None)
        records = c["records"]
        assert len(records) == TOY.factor and all(len(docs) == 2 for docs in records)
        found = [{k: v for k, v in p.items() if k != "answer_recall"} for p in c["by_position"]]
        assert found == [report.accuracy(docs) | {"position": k + 1} for k, docs in enumerate(records)]
        assert c["overall"] == report.accuracy([d for docs in records for d in docs])
        assert c["overall"]["answers"] == 2 * TOY.factor * len(TOY.depths)
        if sparse:
            kept = [[d["answer_recall"] for d in docs] for docs in records]
            assert all(0 < x <= 1 for row in kept for x in row) and len({x for row in kept for x in row}) > 1
            assert [p["answer_recall"] for p in c["by_position"]] == pytest.approx([sum(r) / 2 for r in kept])
            assert len(c["densities"]) == len(c["recalls"]) == 2
            assert all(0 < x <= 1 for x in c["densities"] + c["recalls"])
            assert c["density"] == pytest.approx(sum(c["densities"]) / 2)
            assert c["recall"] == pytest.approx(sum(c["recalls"]) / 2)
        else:
            assert c["density"] is None and c["recall"] is None and c["densities"] == c["recalls"] == []
            assert all("answer_recall" not in d for docs in records for d in docs)
            assert all(p["answer_recall"] is None for p in c["by_position"])
    masked, unmasked = result["conditions"]["sparse_masked"], result["conditions"]["sparse_unmasked"]
    assert masked["densities"] != unmasked["densities"]  # of the pairs within documents vs all causal pairs
    for name, (a, b) in pr.DIFFERENCES.items():
        ca, cb = result["conditions"][a]["records"], result["conditions"][b]["records"]
        assert result["differences"][name] == [report.difference(x, y) for x, y in zip(ca, cb)]
    assert "| sparse_masked |" in pr.table(result)
    # the same budget masked twice: the same patterns and answers (the conditions are measured, not filled in)
    again = result["conditions"]["sparse_masked_v10"]
    assert again["densities"] == masked["densities"] and again["records"] == masked["records"]


def test_run_reads_another_model(tmp_path):
    """``model``: an export read instead of the base (here the toy base's own), named after its run folder."""
    base = pr.base_export(TOY, tmp_path / "work", seed=0)
    result = pr.run(TOY, tmp_path / "unused", tmp_path / "out", samples=1, seed=0, model=base)
    assert result["name"] == f"packed_recall_{base.parent.name}" and result["model"] == str(base)
    assert (tmp_path / "out" / f"{result['name']}.json").exists() and not (tmp_path / "unused").exists()
