"""Training checkpoints (orbax CheckpointManager, async), with an integrity record per step.

Folder layout (`<outputs>/<experiment>/checkpoints/`):

    <step>/                     one checkpoint; <step> = optimizer steps applied
      params/                   the weights: trainable params (nnx.State)           ┐ all that sampling,
      frozen/                   the weights: frozen Params and Buffers (nnx.State)  │ `convert to-torch`
      ema/                      the weights: EMA of the params (float32)            ┘ and --ckpt-path read
      opt_state/                the rest of the TrainState, for --load: optimizer state, step, rng
      config/                   JSON: the resolved run config, with "model" = STDiT3Config fields
      data/                     JSON: the loader state (epoch, index, fingerprint)
      meta/                     JSON: wandb run id, jaxsora version, mesh, process count, wall time,
                                "checkpoint_format": 3 (see "Older layouts" below)
      integrity.json            the completion marker and checksums (see below)
    <step>.orbax-checkpoint-tmp a save in progress (or one that died): never read

Every array item is an orbax item of its own (its own folder, OCDBT database and metadata), so the
weights never share a file with the optimizer state: `rsync -a --exclude opt_state RUN/ COPY/`
gives a copy that sampling (`python -m jaxsora.sample`, the inference server), `python -m
jaxsora.convert to-torch` and `--ckpt-path` read as they read the run, and that `--load` refuses
with one line naming the missing `opt_state` item. An item holds a dict {TrainState field:
subtree}: params/ holds {"params": ...}, opt_state/ holds {"opt_state": ..., "step": ..., "rng":
...} (step and rng go with the optimizer: only a full resume needs them, and a weights-only reader
takes the step from the folder's name). So an array's name inside its item is its TrainState path
(e.g. "params.blocks.0.attn.qkv.kernel.value"), whatever the layout. `split_items` is the rule:
fields params, frozen, ema → the item of that name; every other field → opt_state.

Older layouts, still read everywhere (full resume, weights only, convert, sample, serve, `ckpt`):
a step folder with a `state/` folder holds the whole TrainState in that one item (checkpoint_format
2 with integrity.json; no "checkpoint_format" and no integrity.json before that; `convert
from-torch` outputs wrote a `state/` item with params and ema). The layout is recognised by the
`state/` folder alone; reading only the weights of such a step reads only their arrays of it.

Integrity. When `Checkpointer.save` is called, one jitted program computes a 64-bit fingerprint
of every array of the TrainState on the device (`train.fingerprint.device_fingerprints`); it is dispatched
asynchronously, like the save itself, so the step loop does not wait for it. The fingerprint is
layout independent: each array is read as its logical C-order sequence of 32-bit words (2-byte
and 1-byte dtypes widened, 8-byte dtypes split in two, low word first) and reduced with integer
sums modulo 2^32, which are exact whatever the sharding or the reduction order — a checkpoint
saved on one mesh verifies on another, and `host_fingerprint` (numpy) gives the same bits.
Orbax writes a step into `<step>.orbax-checkpoint-tmp` and renames it to `<step>` when every
process has finished; just before that rename, in orbax's finalize thread, process 0 fetches the
fingerprints and writes `integrity.json` into the folder ({"complete": true, "items": {item:
{"arrays", "bytes"}} of every array item written, "arrays": {array name: {"item", "shape",
"dtype", "fingerprint"}} covering every item, a sha256 of each JSON item, the jaxsora version}).
The marker is therefore committed by the same atomic rename as the data: a `<step>/` folder of
this format without it was not written by a finished save. Multi-host: the fingerprints are
global reductions, so every process holds the same values; only process 0 writes the record and
prints, and restore's skip decisions are agreed between processes. (Records of the `state/`
layout, format 1, have no "item"s: an array's item follows from its name's first part.)

`restore` reads the newest step (or the one asked for) — all items (a full resume) or some (e.g.
`WEIGHT_ITEMS`: the optimizer's folder is then never opened) — recomputes the fingerprints of the
arrays it read and compares them with the record's arrays of those items only; a step that is
partial, unreadable or does not match is skipped with one line on stderr and the next older one
is tried (an explicitly named step raises `CheckpointError`). A step without the opt_state item
(a copy of the weights) stops a full restore at once with one line naming the item. Checkpoints
older than integrity records restore with a one-line note that they are unverified. A failed
write (disk full, I/O error) raises `CheckpointWriteError` with one line, and the unfinished step
folder is removed so the earlier checkpoints stay the newest.

The newest `keep` checkpoints are kept (`keep=0`: all). Restoring uses an abstract target that

The package, by concern: `layout` (items, errors, finding steps), `integrity` (the record),
`orbax_io` (reading stored items), `save` (`Checkpointer`), `restore_state` (`restore`,
`check_resumable`), `weights` (weights-only readers), `verify` (`verify_step`, the `ckpt` CLI).
Everything is imported from `jaxsora.checkpoint`, as before the split.
"""
from jaxsora.lazy_imports import lazy_names

# Each name's module loads on first use (`from jaxsora.checkpoint import X`): finding a checkpoint (`layout`) imports
# no jax, so a command can answer a wrong checkpoint path before importing it.
__getattr__, __dir__, __all__ = lazy_names(__name__, {
    "integrity": ("_integrity_doc", "_json_digest", "write_integrity_record"),
    "layout": ("ARRAY_ITEMS", "CHECKPOINT_FORMAT", "FINGERPRINT_METHOD", "INTEGRITY_FILE", "INTEGRITY_FORMAT", "ITEMS",
               "JSON_ITEMS", "LEGACY_ITEM", "OPT_ITEM", "TMP_SUFFIX", "WEIGHT_ITEMS", "CheckpointError",
               "CheckpointNotFoundError", "CheckpointWriteError", "checkpoint_steps", "has_weights", "is_legacy_layout",
               "item_of", "read_config", "resolve_checkpoint", "resolve_step_dir", "split_items",
               "unfinished_saves"),
    "orbax_io": ("_host_item", "item_metadata_tree"),
    "restore_state": ("check_resumable", "restore"),
    "save": ("Checkpointer",),
    "verify": ("StepReport", "folder_bytes", "step_contents", "verify_step"),
    "weights": ("LEGACY_EXTRA_FIELDS", "read_json_item", "read_weights", "verify_arrays", "weight_fields"),
})
