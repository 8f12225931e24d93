"""Multi-host start-up: `jax.distributed.initialize` from flags, SLURM or JAX_* variables.

Order: explicit arguments (--coordinator/--num-processes/--process-id) → SLURM (SLURM_NTASKS > 1:
coordinator = first host of SLURM_JOB_NODELIST, port JAXSORA_PORT or 12355, id = SLURM_PROCID)
→ JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID. With none, a single process.
"""
from __future__ import annotations

import os
import re
import sys
from typing import Optional

_initialized = False


def _first_slurm_host(nodelist: str) -> str:
    """'node[01-04,07],other' → 'node01' (the first host of a SLURM node list)."""
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if not m:
        return nodelist
    prefix, _, ranges = m.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def resolve(coordinator: Optional[str] = None, num_processes: Optional[int] = None,
            process_id: Optional[int] = None, env=None) -> Optional[dict]:
    """The initialize() arguments this process should use, or None for a single process."""
    env = os.environ if env is None else env
    if coordinator or num_processes or process_id is not None:
        if not (coordinator and num_processes and process_id is not None):
            raise ValueError("multi-host flags need all of --coordinator, --num-processes and --process-id")
        return dict(coordinator_address=coordinator, num_processes=int(num_processes), process_id=int(process_id))
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_NODELIST" in env:
        host = _first_slurm_host(env["SLURM_JOB_NODELIST"])
        return dict(coordinator_address=f"{host}:{env.get('JAXSORA_PORT', '12355')}",
                    num_processes=int(env["SLURM_NTASKS"]), process_id=int(env["SLURM_PROCID"]))
    if env.get("JAX_COORDINATOR_ADDRESS") and env.get("JAX_NUM_PROCESSES"):
        return dict(coordinator_address=env["JAX_COORDINATOR_ADDRESS"], num_processes=int(env["JAX_NUM_PROCESSES"]),
                    process_id=int(env.get("JAX_PROCESS_ID", "0")))
    return None


def initialize(coordinator: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None) -> bool:
    """Initialize jax.distributed once if this is a multi-process run; returns whether it did."""
    global _initialized
    if _initialized:
        return True
    args = resolve(coordinator, num_processes, process_id)
    if args is None:
        return False
    import jax

    jax.distributed.initialize(**args)
    _initialized = True
    if jax.process_index() == 0:
        print(f"[jaxsora] jax.distributed: {args['num_processes']} processes, coordinator "
              f"{args['coordinator_address']}, {jax.device_count()} devices", file=sys.stderr)
    return True
