"""Run by tests/convert/test_reference_crosscheck.py under the reference harness's python
(/tmp/refenv): load a state dict strict into the real Open-Sora STDiT3 and run its forward.

usage: ref_forward.py CONFIG_JSON WEIGHTS IO_NPZ OUT_NPZ [--export SD_OUT]
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.environ.get("REFHARNESS", os.path.join(os.path.dirname(__file__), "../../../shared/refharness")))
import ref_stdit3 as R  # noqa: E402

cfg_json, weights, io_path, out_path = sys.argv[1:5]
R.setup(os.environ.get("OPENSORA_REF_DIR", "/tmp/opensora-ref"))
cfg = json.loads(cfg_json)
cfg["patch_size"] = tuple(cfg["patch_size"])
model = R.build(cfg, seed=123)
missing, unexpected = R.load_state_dict(model, weights, strict=True)
assert not missing and not unexpected, (missing, unexpected)
io = np.load(io_path)
get = lambda k: io[k] if k in io else None  # noqa: E731, SIM401 (an NpzFile)
out = R.forward(model, io["x"], io["timestep"], io["y"], get("mask"), x_mask=get("x_mask"),
                fps=get("fps"), height=get("height"), width=get("width"))
res = {"out": out}
if "--export" in sys.argv:  # the reference's own state dict, for the from-torch direction
    R.randomize_(model, seed=7)
    R.save_state_dict(model, sys.argv[sys.argv.index("--export") + 1])
    res["out_exported"] = R.forward(model, io["x"], io["timestep"], io["y"], get("mask"), x_mask=get("x_mask"),
                                    fps=get("fps"), height=get("height"), width=get("width"))
np.savez(out_path, **res)
