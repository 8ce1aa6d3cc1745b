"""`mtraining convert`: a GGUF checkpoint written by the test, converted to a Hugging Face folder, computes what
transformers computes from the GGUF itself; bad input names the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from mtraining.cli import app
from mtraining.models.convert import convert_gguf
from tests.gguf_files import write_tiny_gguf

IDS = torch.tensor([[3, 70, 120, 260, 7, 2, 200, 268, 45, 99]])


def _logits(folder: Path, **kwargs) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa", **kwargs)
    with torch.no_grad():
        return model.eval()(IDS).logits


@pytest.mark.parametrize("arch, tied", [("llama", True), ("qwen2", False)])
def test_converted_model_computes_what_transformers_reads_from_the_gguf(tmp_path, arch, tied):
    gguf = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, tied=tied)
    result = convert_gguf(gguf, tmp_path / "hf", report=lambda line: None)
    assert (result.model_type, result.layers, result.dtype) == (arch, 2, "float32")
    expected = _logits(tmp_path, gguf_file=gguf.name)
    assert torch.equal(_logits(tmp_path / "hf"), expected)  # float32: the dequantized weights exactly
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "gguf_source.json"):
        assert (tmp_path / "hf" / name).is_file(), name
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is tied
    source = json.loads((tmp_path / "hf" / "gguf_source.json").read_text())
    assert source["architecture"] == arch and source["bytes"] == gguf.stat().st_size


def test_the_tokenizer_keeps_the_files_special_tokens_and_the_trainer_reads_it(tmp_path):
    from mtraining.data.tokenizer import TextTokenizer
    from mtraining.models import build_config

    gguf = write_tiny_gguf(tmp_path / "m.gguf")
    convert_gguf(gguf, tmp_path / "hf", report=lambda line: None)
    tok = TextTokenizer(tmp_path / "hf")
    assert tok.eos == "<|im_end|>" and tok.separator_id(None) == 2  # the file's eos_token_id
    assert tok.encode("the cat") == [119, 260, 35, 102, 268]  # bytes 3 + b, merges "h e" -> 260, "a t" -> 268
    assert build_config(tmp_path / "hf").vocab_size == tok.vocab_size


def test_bfloat16_weights_stay_close(tmp_path):
    from safetensors import safe_open

    gguf = write_tiny_gguf(tmp_path / "m.gguf")
    convert_gguf(gguf, tmp_path / "hf", dtype="bfloat16", report=lambda line: None)
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    torch.testing.assert_close(_logits(tmp_path / "hf"), _logits(tmp_path, gguf_file=gguf.name), atol=0.2, rtol=0.05)


def test_bad_input_names_the_fix(tmp_path, monkeypatch):
    gguf = write_tiny_gguf(tmp_path / "m.gguf")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    (tmp_path / "text.gguf").write_text("not a gguf")
    for args, message in (
        ((gguf, tmp_path / "full"), "exists and is not an empty folder"),
        ((tmp_path / "missing.gguf", tmp_path / "a"), "does not exist"),
        ((tmp_path / "text.gguf", tmp_path / "a"), "is not a GGUF file"),
        ((gguf, tmp_path / "a", "int8"), "is not one of float32, bfloat16, float16"),
    ):
        with pytest.raises(ValueError, match=message):
            convert_gguf(*args, report=lambda line: None)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ValueError, match=r'needs the gguf package: pip install -e "\.\[gguf\]"'):
        convert_gguf(gguf, tmp_path / "a", report=lambda line: None)


def test_an_architecture_mtraining_does_not_train_is_refused(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    for add, value in ((writer.add_block_count, 1), (writer.add_context_length, 64), (writer.add_embedding_length, 8)):
        add(value)
    writer.add_head_count(2)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="holds a 'gpt2' model; mtraining trains qwen2, qwen3, llama, mistral"):
        convert_gguf(path, tmp_path / "hf", report=lambda line: None)


def test_a_gguf_given_as_a_model_names_the_convert_command(tmp_path):
    from mtraining.eval.loading import load
    from mtraining.train.config import load_config

    gguf = write_tiny_gguf(tmp_path / "m.gguf")
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {{path: {gguf}}}\ndata: {{sources: [x.npy], seq_len: 64}}\ntrain: {{steps: 1}}\n")
    with pytest.raises(ValueError, match=f"model.path {gguf} is a GGUF file; convert it once with `mtraining convert"):
        load_config(config, [])
    for checkpoint in (gguf, tmp_path):  # the file, or a folder holding it without config.json
        with pytest.raises(ValueError, match="is a GGUF file; convert it once with `mtraining convert"):
            load(checkpoint)


def test_the_command_prints_the_model_and_exits_2_on_bad_input(tmp_path):
    gguf = write_tiny_gguf(tmp_path / "m.gguf")
    run = CliRunner().invoke(app, ["convert", str(gguf), str(tmp_path / "hf"), "--dtype", "bfloat16"])
    assert run.exit_code == 0, run.output
    assert "model_type: llama" in run.output and "eos_token: <|im_end|>" in run.output
    run = CliRunner().invoke(app, ["convert", str(gguf), str(tmp_path / "hf")])
    assert run.exit_code == 2 and "exists and is not an empty folder" in run.output
