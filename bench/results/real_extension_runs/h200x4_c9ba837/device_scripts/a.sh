#!/bin/bash
# Call A: where a 64K evaluation prefill goes, on a random SmolLM2-135M-shaped model (YaRN x8, bf16).
set -x
PY=/opt/torch/.venv/bin/python3
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.used --format=csv
$PY - <<'PYEOF'
import json, shutil, torch
from pathlib import Path
from transformers import AutoConfig, AutoModelForCausalLM
cfg = json.load(open(".gguf/tok/config.json"))
cfg["rope_parameters"] = {"rope_theta": 100000.0, "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192}
cfg["max_position_embeddings"] = 65536
out = Path("/tmp/smol"); out.mkdir(exist_ok=True)
json.dump(cfg, open(out / "config.json", "w"))
config = AutoConfig.from_pretrained(out)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
model.save_pretrained(out)
for f in Path(".gguf/tok").iterdir():
    if f.name != "config.json":
        shutil.copy(f, out / f.name)
print("saved", sorted(p.name for p in out.iterdir()))
PYEOF
timeout 420 $PY bench/eval_prefill.py --model /tmp/smol --lengths 32768 65536 --repeats 2 --profile --out $OUT/eval_prefill.json 2>&1 | tail -150
ls -la $OUT
