"""Multi-host start-up: `jax.distributed.initialize`, explicit settings first, then jax's own cluster detection.

Each of the three settings (coordinator host:port, process count, process id) comes from the first of:
  1. flags: --coordinator / --num-processes / --process-id;
  2. JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID (set by `jaxsora.cluster launch` and
     launch/jobset.yaml);
  3. the cluster jax itself detects (its `jax._src.clusters` classes, in jax's order: Open MPI, SLURM,
     Cloud TPU, Kubernetes Job/JobSet). Under SLURM: coordinator = first host of SLURM_STEP_NODELIST,
     port JAX_COORDINATOR_PORT (else derived from SLURM_JOB_ID), count SLURM_NTASKS, id SLURM_PROCID.
With all three given explicitly no cluster is consulted (so stale or surrounding SLURM variables change
nothing). With none of them and no cluster, or a count of 1, this is a single process and
jax.distributed is not started.

What jaxsora adds to jax: one-line errors (exit code 2) for inconsistent settings, a line saying where
the settings came from (printed before connecting, so a hang or a timeout shows what was tried), the
single-process path, the initialization timeout (JAXSORA_INIT_TIMEOUT, default jax's 300 s), the peer watch
(`jaxsora.parallel.peers`: a lost process ends the others in one line, exit 76), for the trainer a parent
process that reports its end however it ends (`before_connect`: `jaxsora.train.run.agent`), and two corrections
of jax's detection:
  - jax restricts every process of a detected SLURM / Open MPI job to one GPU (its local rank). jaxsora
    runs one process per node driving all its GPUs (launch/slurm.sbatch), so with one process on each
    node nothing is restricted; with several per node jax's one-GPU-per-process default stays.
    JAX_LOCAL_DEVICE_IDS (read by jax) overrides both.
  - jax's SLURM node-list parser takes 'rack1' as the first host of 'rack[1-2]-gpu[1-4]'; the host is
    corrected (the port stays jax's).
"""
from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable

from jaxsora.errors import UserError

DEFAULT_TIMEOUT = 300  # seconds; jax.distributed.initialize's own default
TIMEOUT_ENV = "JAXSORA_INIT_TIMEOUT"
_ENV = dict(coordinator_address="JAX_COORDINATOR_ADDRESS", num_processes="JAX_NUM_PROCESSES",
            process_id="JAX_PROCESS_ID")
_FLAG = dict(coordinator_address="--coordinator", num_processes="--num-processes", process_id="--process-id")
_announced = False


class DistributedError(UserError, ValueError):
    """Multi-host settings that do not fit together."""


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM host list: 'node[01-04,07],gpu9' → 'node01', 'rack[1-2]-gpu[1-4]' → 'rack1-gpu1'."""
    first = re.split(r",(?![^\[]*\])", nodelist.strip(), maxsplit=1)[0]  # the first top-level item
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1), maxsplit=1)[0], first)


def detected_cluster():
    """The cluster environment jax.distributed.initialize() would detect (jax's classes, jax's order), or None.
    Returns (class, note): note is what a detector warned (e.g. Kubernetes without the `kubernetes` package)."""
    from jax._src import clusters  # jax has no public name for its detection

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        env = next((c for c in clusters.ClusterEnv._cluster_types
                    if not c.opt_in_only_method and c.is_env_present()), None)
    note = " ".join(str(caught[0].message).split()).split(". ")[0] if caught else ""  # its first sentence
    return env, note


def cluster_name(env) -> str:
    return env.name or env.__name__.replace("Cluster", "").lower()  # jax's K8sCluster has no name


def _one_process_per_node(name: str) -> bool:
    e = os.environ
    if name == "slurm":
        nodes = e.get("SLURM_STEP_NUM_NODES") or e.get("SLURM_NNODES")
        return bool(nodes) and nodes == e.get("SLURM_NTASKS")
    if name == "ompi":
        return e.get("OMPI_COMM_WORLD_LOCAL_SIZE") == "1"
    return False


def _int(value, origin: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise DistributedError(f"{origin}={value!r} is not an integer") from None


def _explicit(coordinator, num_processes, process_id, env) -> tuple[dict, dict]:
    """(values, origins) of the settings given by flags or JAX_* variables."""
    given = dict(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    values, origins = {}, {}
    for key, flag_value in given.items():
        if flag_value is not None and flag_value != "":
            values[key], origins[key] = flag_value, _FLAG[key]
        elif env.get(_ENV[key], "") != "":
            values[key], origins[key] = env[_ENV[key]], _ENV[key]
    for key in ("num_processes", "process_id"):
        if key in values:
            values[key] = _int(values[key], origins[key])
    return values, origins


def _label(origins: dict, cluster: str | None) -> str:
    """Where the settings came from, in words: 'flags', 'JAX_* variables', 'slurm (detected by jax)', or a mix."""
    kinds = []
    for origin in origins.values():
        kind = ("flags" if origin.startswith("--") else "JAX_* variables" if origin.startswith("JAX_")
                else f"{cluster} (detected by jax)")
        if kind not in kinds:
            kinds.append(kind)
    return " + ".join(kinds)


def plan(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
         env=None, timeout: int | None = None) -> tuple[dict | None, str]:
    """(initialize() arguments or None for a single process, where they came from in words).

    `env` holds the explicit JAX_* variables (default os.environ); the cluster detection is jax's and
    reads os.environ."""
    env = os.environ if env is None else env
    values, origins = _explicit(coordinator, num_processes, process_id, env)
    cluster, args = None, {}
    if len(values) < 3:  # consult jax's detection only for what was not given
        found, note = detected_cluster()
        if found is None:
            if not values:
                return None, ("single process (no multi-host flags, JAX_* variables or detected cluster"
                              + (f"; jax: {note}" if note else "") + ")")
        else:
            cluster = cluster_name(found)
            if "num_processes" not in values:
                values["num_processes"], origins["num_processes"] = int(found.get_process_count()), cluster
            if values["num_processes"] > 1 or "process_id" in values:
                if "process_id" not in values:
                    values["process_id"], origins["process_id"] = int(found.get_process_id()), cluster
                if "coordinator_address" not in values and values["num_processes"] > 1:
                    port = os.environ.get("JAX_COORDINATOR_PORT")
                    address = found.get_coordinator_address(timeout_secs=timeout, override_coordinator_port=port)
                    if cluster == "slurm":  # jax's node-list parser misreads several bracket ranges
                        address = f"{first_slurm_host(os.environ['SLURM_STEP_NODELIST'])}:{address.rsplit(':', 1)[1]}"
                    values["coordinator_address"], origins["coordinator_address"] = address, cluster
                local = found.get_local_process_id()
                if (local is not None and values["num_processes"] > 1 and not os.environ.get("JAX_LOCAL_DEVICE_IDS")
                        and not _one_process_per_node(cluster)):
                    args["local_device_ids"] = [int(local)]  # jax's default: one device per process
    source = _label(origins, cluster)
    _check(values, origins, source)
    if values["num_processes"] == 1:
        return None, f"single process (a process count of 1 from {source})"
    return dict(coordinator_address=str(values["coordinator_address"]), num_processes=values["num_processes"],
                process_id=values["process_id"], **args), source


def _check(values: dict, origins: dict, source: str) -> None:
    def named(key):
        origin, value = origins[key], values[key]
        if origin.startswith("--"):
            return f"{origin} {value}"
        return f"{origin}={value}" if origin.startswith("JAX_") else f"{key.replace('_', ' ')} {value} from {origin}"

    if "num_processes" not in values:
        given = ", ".join(named(k) for k in values)
        raise DistributedError(f"multi-host settings without a process count: {given} given, but no --num-processes, "
                               f"JAX_NUM_PROCESSES or detected cluster; give the count (and coordinator and process "
                               f"id) or unset the rest")
    n = values["num_processes"]
    if n < 1:
        raise DistributedError(f"{named('num_processes')}: the process count must be at least 1")
    if n > 1:
        for key, how in (("coordinator_address", "--coordinator / JAX_COORDINATOR_ADDRESS (host:port)"),
                         ("process_id", "--process-id / JAX_PROCESS_ID")):
            if key not in values:
                raise DistributedError(f"{named('num_processes')} needs {how} too (settings from {source})")
    if "process_id" in values and not 0 <= values["process_id"] < n:
        raise DistributedError(f"{named('process_id')} is out of range for {n} process{'es' if n > 1 else ''} "
                               f"(ids 0..{n - 1}; settings from {source})")
    if n > 1 and not re.fullmatch(r".+:\d+", str(values["coordinator_address"])):
        raise DistributedError(f"{named('coordinator_address')} needs a port: host:port")


def resolve(coordinator: str | None = None, num_processes: int | None = None,
            process_id: int | None = None, env=None) -> dict | None:
    """The initialize() arguments this process should use, or None for a single process."""
    return plan(coordinator, num_processes, process_id, env=env)[0]


def _timeout(timeout: int | None) -> int:
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV, "")
        timeout = _int(raw, TIMEOUT_ENV) if raw != "" else DEFAULT_TIMEOUT
    if int(timeout) < 1:
        raise DistributedError(f"the jax.distributed initialization timeout must be at least 1 s, got {timeout}")
    return int(timeout)


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, timeout: int | None = None,
               before_connect: Callable[[int, int], None] | None = None) -> bool:
    """Initialize jax.distributed once if this is a multi-process run; returns whether it is initialized.

    `timeout`: seconds to wait for every process to connect (default: JAXSORA_INIT_TIMEOUT, else 300).
    `before_connect(process_id, num_processes)`: called in a multi-process run just before connecting (the
    trainer's parent process forks there: `jaxsora.train.run.agent.start`).
    Prints where the settings came from (every process of a multi-process run, before connecting)."""
    global _announced
    import jax

    if jax.distributed.is_initialized():
        return True
    timeout = _timeout(timeout)
    args, source = plan(coordinator, num_processes, process_id, timeout=timeout)
    if args is None:
        if not _announced:
            print(f"[jaxsora] {source}", flush=True)
            _announced = True
        return False
    local = f", local devices {args['local_device_ids']}" if "local_device_ids" in args else ""
    print(f"[jaxsora] jax.distributed from {source}: process {args['process_id']} of {args['num_processes']}, "
          f"coordinator {args['coordinator_address']}{local} (waiting up to {timeout} s for every process)",
          flush=True)
    if before_connect is not None:
        before_connect(args["process_id"], args["num_processes"])
    # Everything explicit: jax's own detection must not add its SLURM/Open MPI one-GPU restriction.
    jax.distributed.initialize(**args, initialization_timeout=timeout, cluster_detection_method="deactivate")
    _announced = True
    if jax.process_index() == 0:
        print(f"[jaxsora] jax.distributed: {jax.process_count()} processes, {jax.device_count()} devices", flush=True)
    from jaxsora.parallel import peers

    peers.start(jax.process_count(), jax.process_index())  # a lost process ends the others in one line
    return True
