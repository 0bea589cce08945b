#!/usr/bin/env python3
# usage: check_safetensors.py CHECKPOINT_DIR MODEL.safetensors MASTER.safetensors
# Loads shardswap's safetensors exports with the `safetensors` package and compares every tensor
# with values read straight from the checkpoint's own files by this independent parser.
import json, struct, sys, glob, os
import torch
import safetensors
from safetensors.torch import load_file

d = sys.argv[1]
meta = json.loads(open(os.path.join(d, "metadata.json"), "rb").read())["metadata"]

def binary(path):
    b = open(path, "rb").read()
    assert b[:8] == b"SSCKPT01"
    (h,) = struct.unpack("<Q", b[8:16])
    return json.loads(b[16:16 + h]), b[16 + h:-8]

wh, wdata = binary(os.path.join(d, "weights.bin"))
dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[wh["dtype"]]
shapes = {p["name"]: p["shape"] for p in meta["params"]}
weights = {}
for e in wh["params"]:
    t = torch.frombuffer(bytearray(wdata[e["offset"]:e["offset"] + e["bytes"]]), dtype=dt)
    weights[e["name"]] = t.reshape(shapes[e["name"]])
masters = {n: w.float().flatten().clone() for n, w in weights.items()}
for f in sorted(glob.glob(os.path.join(d, "rank-*.bin"))):
    h, data = binary(f)
    for p in h["pieces"]:
        v = torch.frombuffer(bytearray(data[p["offset"]:p["offset"] + 4 * p["count"]]), dtype=torch.float32)
        masters[p["param"]][p["begin"]:p["begin"] + p["count"]] = v
model = load_file(sys.argv[2], device="cuda")
master = load_file(sys.argv[3], device="cuda")
bad = 0
for n, w in weights.items():
    ok1 = model[n].dtype == w.dtype and tuple(model[n].shape) == tuple(w.shape) and torch.equal(model[n].cpu(), w)
    ok2 = master[n].dtype == torch.float32 and torch.equal(master[n].cpu().flatten(), masters[n])
    bad += (not ok1) + (not ok2)
first = next(iter(weights))
print(f"safetensors {safetensors.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
print(f"{len(model)} bit16 tensors ({model[first].dtype}), {len(master)} fp32 master tensors; "
      f"mismatches against the checkpoint files: {bad}")
print("e.g.", first, tuple(model[first].shape), model[first].flatten()[:4].tolist())
sys.exit(1 if bad else 0)
