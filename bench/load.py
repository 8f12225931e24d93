"""Host and device memory of loading STDiT3 weights onto a mesh (`--ckpt-path`), measured.

    python bench/load.py --make /tmp/xl2.safetensors            # once: a random STDiT3-XL/2 state dict (4.8 GB)
    python bench/load.py --weights /tmp/xl2.safetensors --devices 8 --fsdp 8

Each measurement runs in a fresh process with N fake CPU devices (on CPU, "device" buffers live in
host memory too, so the host's own overhead is peak RSS − RSS before − device bytes):

- `sharded`: jaxsora's path — every array made with `jax.make_array_from_callback` from
  memory-mapped slices, only what the file lacks initialized;
- `whole` (for comparison): read the whole state dict into numpy, build the model on one device,
  then place it (what `--ckpt-path` did before).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def rss_gb() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    return kb / 2**20


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def make(path: str, model: str):
    import numpy as np
    from safetensors.numpy import save_file

    sys.path.insert(0, os.path.join(HERE, ".."))
    from jaxsora.convert.torch import torch_shapes
    from jaxsora.models.presets import get_model_config

    rng = np.random.default_rng(0)
    tensors = {k: (0.02 * rng.standard_normal(shape, dtype=np.float32)) for k, shape in
               torch_shapes(get_model_config(model))}
    save_file(tensors, path)
    print(f"wrote {len(tensors)} tensors, {sum(v.nbytes for v in tensors.values()) / 1e9:.2f} GB → {path}")


def measure(args) -> dict:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, os.path.join(HERE, ".."))
    import jax

    import jaxsora.models  # noqa: F401
    from jaxsora.models.presets import get_model_config
    from jaxsora.parallel.mesh import logical_rules, make_mesh
    from jaxsora.train.step.optim import AdamW
    from jaxsora.train.step.state import init_variables_sharded, model_variables, plan_state, with_variables

    mesh = make_mesh(dict(data=args.devices // args.fsdp, fsdp=args.fsdp, sequence=1))
    cfg = get_model_config(args.model)
    tx = AdamW.from_config(dict(lr=1e-4)).tx()
    t0 = time.perf_counter()
    plan = plan_state(cfg, tx, 0, mesh, logical_rules(mesh))
    plan_s = time.perf_counter() - t0
    before = rss_gb()
    t0 = time.perf_counter()
    if args.mode == "sharded":
        from jaxsora.convert.sharded import read_torch_weights

        targets = model_variables(plan.abstract_sharded)
        loaded, report = read_torch_weights(args.weights, targets, cfg.model_max_length)
        values = {**init_variables_sharded(plan, set(targets) - set(loaded)), **loaded}
        arrays = with_variables(plan, values)
    else:
        from jaxsora.convert.torch import from_torch_state_dict, read_state_dict
        from jaxsora.train.step.state import split_model

        model = from_torch_state_dict(read_state_dict(args.weights), cfg)
        _, params, frozen = split_model(model)
        arrays = jax.device_put((params, frozen), (plan.shardings.params, plan.shardings.frozen))
        del model, params, frozen
    jax.block_until_ready(arrays)
    seconds = time.perf_counter() - t0
    per_device = {}
    for leaf in jax.tree.leaves(arrays):
        for shard in leaf.addressable_shards:
            per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes
    device_gb = sum(per_device.values()) / 2**30
    return dict(mode=args.mode, devices=args.devices, fsdp=args.fsdp, plan_s=plan_s, load_s=seconds,
                rss_before_gb=before, peak_rss_gb=peak_gb(), device_total_gb=device_gb,
                device_max_gb=max(per_device.values()) / 2**30,
                host_overhead_gb=peak_gb() - before - device_gb)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--make", help="write a random state dict of --model to this .safetensors path and exit")
    ap.add_argument("--weights", help="the .safetensors/.pth to load")
    ap.add_argument("--model", default="STDiT3-XL/2")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--fsdp", type=int, default=8)
    ap.add_argument("--modes", default="sharded,whole")
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.make:
        return make(args.make, args.model)
    if args.mode:  # the child process
        print("RESULT " + json.dumps(measure(args)), flush=True)
        return
    rows = []
    for mode in args.modes.split(","):
        cmd = [sys.executable, __file__, "--weights", args.weights, "--model", args.model, "--devices",
               str(args.devices), "--fsdp", str(args.fsdp), "--mode", mode]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            print(f"{mode}: failed\n{out.stderr[-2000:]}")
            continue
        rows.append(json.loads(out.stdout.split("RESULT ", 1)[1]))
    print(f"\n{args.model} from {args.weights}, {args.devices} CPU devices, fsdp {args.fsdp}")
    print(f"{'mode':<8} {'load s':>7} {'RSS before':>10} {'peak RSS':>9} {'device total':>12} {'max/device':>10} "
          f"{'host overhead':>13}  (GiB)")
    for r in rows:
        print(f"{r['mode']:<8} {r['load_s']:>7.1f} {r['rss_before_gb']:>10.2f} {r['peak_rss_gb']:>9.2f} "
              f"{r['device_total_gb']:>12.2f} {r['device_max_gb']:>10.2f} {r['host_overhead_gb']:>13.2f}")


if __name__ == "__main__":
    main()
