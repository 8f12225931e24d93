"""Training checkpoints (orbax CheckpointManager, async).

Folder layout (`<outputs>/<experiment>/checkpoints/`):

    <step>/                     one checkpoint; <step> = optimizer steps applied
      state/                    TrainState: step, params (trainable), frozen (frozen Params and
                                Buffers), opt_state, ema, rng — sharded arrays (OCDBT/zarr)
      config/                   JSON: the resolved run config, with "model" = STDiT3Config fields
      data/                     JSON: the loader state (epoch, index, fingerprint)
      meta/                     JSON: wandb run id, jaxsora version, mesh, process count, wall time

The newest `keep` checkpoints are kept. Restoring uses an abstract target that carries the
*current* mesh's shardings, so a checkpoint saved on one mesh/device count restores on another.
`python -m jaxsora.convert to-torch <step dir or checkpoints/>` reads the same folders
(`params`/`ema` merged with `frozen`).
"""
from __future__ import annotations

import os
from typing import Any, Optional

import orbax.checkpoint as ocp

ITEMS = ("state", "config", "data", "meta")


class Checkpointer:
    def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        opts = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=opts, item_names=ITEMS)

    def latest_step(self) -> Optional[int]:
        return self.manager.latest_step()

    def save(self, step: int, state, *, config: dict, data: dict, meta: dict, force: bool = False) -> bool:
        if step in self.manager.all_steps():
            return False
        return self.manager.save(
            int(step),
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                config=ocp.args.JsonSave(config),
                data=ocp.args.JsonSave(data),
                meta=ocp.args.JsonSave(meta),
            ),
            force=force,
        )

    def wait(self):
        self.manager.wait_until_finished()

    def close(self):
        self.manager.wait_until_finished()
        self.manager.close()


def restore(directory: str, target, *, step: Optional[int] = None, items: tuple = ITEMS) -> dict[str, Any]:
    """Restore `items` of a checkpoint folder (a `checkpoints/` root or a run's outputs folder).

    target: the TrainState as ShapeDtypeStructs carrying the target shardings (`StatePlan.
    abstract_sharded`): each array is read straight into its shards, on whatever mesh this run has.
    Returns {"step": int, "state": TrainState, "config": dict, "data": dict, "meta": dict}.
    """
    directory = os.path.abspath(directory)
    if os.path.isdir(os.path.join(directory, "checkpoints")):
        directory = os.path.join(directory, "checkpoints")
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"checkpoint folder not found: {directory}")
    mngr = ocp.CheckpointManager(directory, item_names=ITEMS,
                                 options=ocp.CheckpointManagerOptions(read_only=True, create=False))
    step = mngr.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"{directory} holds no checkpoint (no <step>/ folder)")
    args = {}
    if "state" in items:
        args["state"] = ocp.args.StandardRestore(target)
    for name in ("config", "data", "meta"):
        if name in items:
            args[name] = ocp.args.JsonRestore()
    out = mngr.restore(step, args=ocp.args.Composite(**args))
    mngr.close()
    res = {"step": int(step)}
    for name in items:
        res[name] = out[name]
    return res
