"""Reading an offline wandb run's history without a network (tests only).

wandb ≥ 0.2x writes `run-<id>.wandb` with its Go core: a 7-byte header (":W&B", a 2-byte magic, a
version byte) followed by LevelDB-log records in 32 KiB blocks — each record is crc32 (4 bytes),
length (2, little endian), type (1: full, 2: first, 3: middle, 4: last) and the bytes of one
`wandb_internal_pb2.Record`.
"""
import glob
import json
import struct

_HEADER = 7
_BLOCK = 32768


def _records(path):
    data = open(path, "rb").read()
    pos, buf = _HEADER, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        chunk, pos = data[pos:pos + n], pos + n
        if kind == 0 and n == 0:
            break
        if kind == 1:
            yield chunk
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            yield buf + chunk
            buf = b""


def history(wandb_dir: str, run_id: str) -> list[dict]:
    """Every history row ({key: value}) of the offline runs with this id under `wandb_dir`."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for f in sorted(glob.glob(f"{wandb_dir}/wandb/offline-run-*-{run_id}*/run-{run_id}.wandb")):
        for data in _records(f):
            rec = pb.Record()
            rec.ParseFromString(data)
            if rec.WhichOneof("record_type") == "history":
                rows.append({(it.key or "/".join(it.nested_key)): json.loads(it.value_json) for it in rec.history.item})
    return rows
