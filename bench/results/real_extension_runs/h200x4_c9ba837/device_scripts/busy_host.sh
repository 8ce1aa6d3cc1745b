#!/bin/bash
# Verification on one H200 with the host kept busy (2 spinning processes per core): a 64K evaluation prefill with
# the code before (exp/old = c9ba837's mtraining) and after the host-side fix, dense, random SmolLM2 shape.
PY=/opt/torch/.venv/bin/python3
export PYTHONUNBUFFERED=1
$PY - <<'PYEOF'
import json, shutil, torch
from pathlib import Path
from transformers import AutoConfig, AutoModelForCausalLM
cfg = json.load(open(".gguf/tok/config.json"))
cfg["rope_parameters"] = {"rope_theta": 100000.0, "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192}
cfg["max_position_embeddings"] = 65536
out = Path("/tmp/smol"); out.mkdir(exist_ok=True)
json.dump(cfg, open(out / "config.json", "w"))
torch.manual_seed(0)
AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out)).to(torch.bfloat16).save_pretrained(out)
for f in Path(".gguf/tok").iterdir():
    if f.name != "config.json":
        shutil.copy(f, out / f.name)
PYEOF
nproc
for i in $(seq 1 $((2 * $(nproc)))); do timeout 200 sh -c 'while :; do :; done' & done
for which in new old; do
  root=$PWD; [ $which = old ] && root=$PWD/exp/old
  timeout 100 $PY $root/bench/eval_prefill.py --model /tmp/smol --lengths 65536 --arms dense --repeats 1 \
    --out $OUT/eval_prefill_busy_host_$which.json 2>&1 | grep -v Warn | tail -9
done
