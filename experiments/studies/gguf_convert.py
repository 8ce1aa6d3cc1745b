"""A GGUF checkpoint converted by ``mtraining convert`` against transformers reading the GGUF directly.

Converts GGUF into OUT (timed, as ``mtraining convert`` does), then loads both in float32 with SDPA
attention and compares the logits of one short English text (the converted folder's own tokenizer
against the GGUF-built one: equal ids are checked first). Writes the conversion time, the largest
absolute logit difference and the tokenizer's special tokens.

    python -m experiments.studies.gguf_convert /work/scratch/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smollm2 --out /tmp/gguf.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.common import provenance, write_results
from mtraining.models import convert_gguf

TEXT = (
    "The harbour master walked along the quay at dawn, counting the boats that had come in overnight. "
    "def add(a, b):\n    return a + b\n# 12345 apples, 678 pears."
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("out_dir", type=Path, help="a new folder for the converted model")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", type=Path, default=None, help="result JSON (default bench/results/gguf_convert.json)")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = convert_gguf(args.gguf, args.out_dir, args.dtype)
    gguf = args.gguf.resolve()
    ref_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok = AutoTokenizer.from_pretrained(args.out_dir)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    if ids != ref_tok(TEXT, add_special_tokens=False)["input_ids"]:
        raise SystemExit("the converted tokenizer encodes the text differently from the GGUF-built one")
    x = torch.tensor([ids])
    kwargs = dict(dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, **kwargs).eval()(x).logits
        got = AutoModelForCausalLM.from_pretrained(args.out_dir, **kwargs).eval()(x).logits
    record = {
        **provenance(on_gpu=False),
        "gguf": gguf.name,
        "gguf_bytes": gguf.stat().st_size,
        "dtype": args.dtype,
        "convert_s": result.seconds,
        "parameters": result.parameters,
        "tokens": len(ids),
        "max_abs_logit_diff": float((ref - got).abs().max()),
        "max_abs_logit": float(ref.abs().max()),
        "special_tokens": {k: getattr(tok, k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")},
    }
    print(record)
    write_results("gguf_convert", [record], args.out)


if __name__ == "__main__":
    main()
