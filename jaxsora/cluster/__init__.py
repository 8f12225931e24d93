"""`python -m jaxsora.cluster`: start, watch, inspect and stop a multi-host run from one machine.

    python -m jaxsora.cluster --hostfile hosts.txt preflight
    python -m jaxsora.cluster --hostfile hosts.txt launch --run outputs/stage1 -- python -m jaxsora.train ...
    python -m jaxsora.cluster --hostfile hosts.txt status      # GPUs, trainer, step, heartbeat age
    python -m jaxsora.cluster --hostfile hosts.txt dump        # every trainer's Python stacks
    python -m jaxsora.cluster --hostfile hosts.txt stop        # TERM, then KILL, by recorded pid
    python -m jaxsora.cluster --slurm 123456 --run outputs/stage1 status|dump|stop

Hosts are reached with `--ssh` (default `ssh -o BatchMode=yes`) or, for a SLURM job, with
`srun --jobid JOB --overlap`. Modules: hosts (hostfile, SLURM nodes), remote (running scripts),
records (pids.json, heartbeats), launch, status, stop, dump, preflight, clock.
"""
