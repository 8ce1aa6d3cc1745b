"""Regenerate the shipped demo data: ``tiny_corpus.jsonl`` and its byte-level BPE ``tokenizer.json``.

The corpus is synthetic and deterministic: short "inventory logs" in which facts stated early
(who keeps which object where) are asked about later, so a model must look back across the
document to predict the answers -- loss keeps falling as attention learns to retrieve.

    python data/make_tiny_corpus.py            # rewrites both files next to this script
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = (
    "Ada Basil Cora Dov Elin Fitz Gale Hugo Iris Jory Kira Lev Mira Nils Oona Pia Quin Ravi Suki Tam "
    "Uma Vik Wren Xan Yara Zed"
).split()
COLOURS = "red blue green amber silver black white golden violet grey".split()
OBJECTS = "lamp key map coin book cup ring box bell flute knife rope clock mask".split()
PLACES = (
    "north tower|old mill|stone bridge|east gate|river house|glass hall|south farm|deep well|"
    "market square|cedar grove|salt cave|high road"
).split("|")
FILLER = (
    "The wind was cold that morning.|Nobody spoke for a while.|Rain fell on the roofs.|"
    "A cart rolled past the gate.|The fire burned low.|Birds circled over the fields.|"
    "Someone laughed in the next room.|The bells rang twice.|Dust hung in the light.|"
    "The lamps were lit at dusk."
).split("|")
NUMBERS = "one two three four five six seven eight nine ten eleven twelve".split()
EOS = "<|endoftext|>"


def make_document(rng: random.Random) -> str:
    """One log: facts, filler, a counting line, then questions answered from the facts."""
    facts = []
    for name in rng.sample(NAMES, rng.randint(3, 7)):
        thing = f"{rng.choice(COLOURS)} {rng.choice(OBJECTS)}"
        facts.append((name, thing, rng.choice(PLACES)))
    lines = [f"Log {rng.randint(100, 999)}."]
    for name, thing, place in facts:
        lines.append(f"{name} keeps the {thing} in the {place}.")
        lines.extend(rng.sample(FILLER, rng.randint(1, 4)))
    start = rng.randint(0, 6)
    lines.append("Count: " + " ".join(NUMBERS[start : start + rng.randint(3, 6)]) + ".")
    for name, thing, place in rng.sample(facts, len(facts)):
        lines.append(f"Where is the {thing} of {name}? In the {place}.")
        if rng.random() < 0.5:
            lines.append(f"Who keeps the {thing}? {name}.")
    return " ".join(lines)


def main(num_docs: int = 500, vocab_size: int = 512, seed: int = 0) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    here = Path(__file__).parent
    rng = random.Random(seed)
    docs = [make_document(rng) for _ in range(num_docs)]
    with open(here / "tiny_corpus.jsonl", "w") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(docs, trainer)
    tokenizer.save(str(here / "tokenizer.json"))


if __name__ == "__main__":
    main()
