"""Small samples in the official formats, written by the tests: InfiniteBench JSONL and RULER JSONL."""

from __future__ import annotations

import json
from pathlib import Path

from mtraining.eval.infinitebench import FILLER

KEY = "5e6b7b90-710d-4953-9b18-3e96b2cadbf2"
OTHER = "060f3306-5ad1-42a9-a8de-f2a118b33744"


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def needle_context(key: str, before: int, after: int) -> str:
    return FILLER * before + f"The pass key is {key}. Remember it. {key} is the pass key.\n" + FILLER * after


def infinitebench_files(folder: Path, filler: int = 3) -> Path:
    """A few records of each supported task, as on huggingface.co/datasets/xinrongzhang2022/InfiniteBench."""
    write_jsonl(
        folder / "passkey.jsonl",
        [
            {"id": i, "context": needle_context(k, i, filler), "input": "What is the pass key?", "answer": [k]}
            | {"options": []}
            for i, k in enumerate(["71432", "06907"])
        ],
    )
    digits = "3000077442"
    context = FILLER + f"The sequence of digits is {digits}. Remember it. {digits} is the sequence of digits.\n"
    write_jsonl(
        folder / "number_string.jsonl",
        [{"id": 0, "context": context, "input": "What is the sequence of digits?", "answer": [digits], "options": []}],
    )
    question = f'\nKey: "{KEY}"\nThe value associated with the specified key is: '
    context = "JSON data:\n" + json.dumps({OTHER: KEY[::-1], KEY: OTHER})
    write_jsonl(
        folder / "kv_retrieval.jsonl",
        [{"id": 0, "context": context, "input": question, "answer": [OTHER], "options": []}],
    )
    asked = "You should answer with only one number, no other words. The second largest number of the list is: "
    write_jsonl(
        folder / "math_find.jsonl",
        [
            {"id": 0, "context": str([3, 97, 12, 97, 40]), "input": asked, "answer": [40], "options": []},
            {"id": 1, "context": str([1, 2, 3, 4]), "input": asked.replace("second largest", "median"), "answer": 2.5},
        ],
    )
    return folder


def ruler_files(folder: Path) -> Path:
    """RULER's prepare.py layout: SAVE_DIR/TASK/validation.jsonl with input/outputs/length/answer_prefix."""
    prefix = " The special magic numbers for lucky-river mentioned in the provided text are"
    niah = {
        "index": 0,
        "input": "Some special magic numbers are hidden within the following text. "
        + FILLER * 4
        + "One of the special magic numbers for lucky-river is: 8472013.\n"
        + "What are all the special magic numbers for lucky-river mentioned in the provided text?",
        "outputs": ["8472013"],
        "length": 160,
        "length_w_model_temp": 160,
        "answer_prefix": prefix,
        "token_position_answer": 40,
    }
    write_jsonl(folder / "niah_single_1" / "validation.jsonl", [niah, niah | {"index": 1, "outputs": ["1234567"]}])
    qa = {"index": 0, "input": "Document 1: Paris is in France.\n\nQuestion: Where is Paris?", "outputs": ["France"]}
    write_jsonl(folder / "qa_1" / "validation.jsonl", [qa | {"answer_prefix": " Answer:", "length": 40}])
    return folder
