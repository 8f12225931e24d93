"""`preflight`: what breaks a multi-host run before it starts, checked on every host.

- clock: offset against this machine (`clock.measure`); a host more than --max-skew (0.5 s) off the
  hosts' median fails (this machine's own offset does not matter). That far apart, the hosts' time
  sync (chrony/NTP) is not working; such clocks get stepped or slewed later, and a clock jumping
  under a running job breaks the timeouts of NCCL and of jax.distributed's coordination service
  (heartbeats, barriers) — the periodic "NCCL operations have failed or timed out" of the Lambda
  run, fixed by chrony. It also makes logs and heartbeat ages disagree between hosts.
- disk: free space of the outputs folder (checkpoints are written there) ≥ --min-free-gb.
- versions: jaxsora (and a hash of its code), jax and jaxlib as `--python` imports them in the
  working dir; every host must match the first.
- port: the coordinator port is free on the coordinator (nothing listens) and reachable from every
  host (a connection is refused, not dropped or unresolvable).
- shared: the outputs folder is the same folder on every host (orbax writes one checkpoint from all
  processes): a file made there by the first host is seen by all.
Exit code 1 when a check fails.
"""
from __future__ import annotations

import os
import secrets
from concurrent.futures import ThreadPoolExecutor

from jaxsora.cluster import clock, remote
from jaxsora.cluster.table import format_table

PY_CHECK = r"""
import hashlib, os, socket, sys
host, port, bind = sys.argv[1].rsplit(":", 1)[0], int(sys.argv[1].rsplit(":", 1)[1]), sys.argv[2] == "1"
try:
    import jax, jaxlib, jaxsora
    root, h = os.path.dirname(jaxsora.__file__), hashlib.sha256()
    for d, dirs, files in os.walk(root):
        dirs.sort()
        for f in sorted(x for x in files if x.endswith(".py")):
            p = os.path.join(d, f)
            h.update(os.path.relpath(p, root).encode())
            h.update(open(p, "rb").read())
    print("@@versions", f"jaxsora {jaxsora.__version__} ({h.hexdigest()[:8]}), jax {jax.__version__}, "
          f"jaxlib {jaxlib.__version__}")
except Exception as e:
    print("@@versions_error", f"{type(e).__name__}: {e}".splitlines()[0])
if bind:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("", port))
        print("@@bind free")
    except OSError as e:
        print("@@bind", e.strerror or e)
    s.close()
try:
    socket.create_connection((host.strip("[]"), port), timeout=3).close()
    print("@@connect open")
except socket.gaierror as e:
    print("@@connect dns", e)
except ConnectionRefusedError:
    print("@@connect refused")
except (socket.timeout, TimeoutError):
    print("@@connect timeout")
except OSError as e:
    print("@@connect error", e.strerror or e)
"""


def facts_script(ctx, outputs: str, coordinator: str, is_coordinator: bool, python: str, marker: str) -> str:
    q = remote.q
    return f"""cd {q(ctx.workdir)} || {{ echo "@@error cannot cd to" {q(ctx.workdir)}; exit 0; }}
d={q(outputs)}; while [ ! -e "$d" ]; do d=$(dirname "$d"); done
echo "@@disk $(df -Pk "$d" | awk 'NR==2 {{print $4}}') $d"
[ -e {q(os.path.join(outputs, marker))} ] && echo "@@shared yes" || echo "@@shared no"
{q(python)} -c {q(PY_CHECK)} {q(coordinator)} {1 if is_coordinator else 0} 2>&1 || echo "@@versions_error python failed"
"""


def _port(f: dict, is_coordinator: bool, coordinator: str) -> tuple[str, bool]:
    bind, connect = (f.get("bind") or [""])[0], (f.get("connect") or [""])[0]
    if is_coordinator and bind != "free":
        return f"{coordinator} in use ({bind}): a stale run?", False
    if connect == "refused":
        return "free" if is_coordinator else "reachable", True
    if connect == "open":
        return "something listens there already: a stale run?", False
    if connect.startswith("dns"):
        return f"cannot resolve {coordinator.rsplit(':', 1)[0]} ({connect[4:]}): --coordinator ADDRESS", False
    if connect == "timeout":
        return f"no answer from {coordinator} in 3s (firewall?)", False
    return connect or "not checked", False


def preflight(ctx, *, coordinator: str, outputs: str = "outputs", python: str = "python",
              max_skew: float = 0.5, min_free_gb: float = 50.0) -> int:
    marker = f".jaxsora-preflight-{secrets.token_hex(4)}"
    q = remote.q
    outputs_dir = os.path.join(outputs, "")[:-1] or "."
    mk = remote.run(ctx.runner, ctx.hosts[0], f"cd {q(ctx.workdir)} && mkdir -p {q(outputs_dir)} && "
                    f": > {q(os.path.join(outputs_dir, marker))} && echo @@made", ctx.timeout)
    coord_host = coordinator.rsplit(":", 1)[0]
    is_coord = [h == coord_host or h.rsplit("@", 1)[-1] == coord_host for h in ctx.hosts]
    if not any(is_coord):
        is_coord[0] = True  # --coordinator names the first host by another name (its IP)
    try:
        with ThreadPoolExecutor(max_workers=max(1, min(remote.PARALLEL, len(ctx.hosts)))) as pool:
            skews = list(pool.map(lambda h: clock.measure(ctx.runner, h, ctx.timeout), ctx.hosts))
        results = remote.run_all(ctx.runner, ctx.hosts, lambda i, h: facts_script(
            ctx, outputs_dir, coordinator, is_coord[i], python, marker), ctx.timeout + 60)
    finally:
        remote.run(ctx.runner, ctx.hosts[0], f"cd {q(ctx.workdir)} && rm -f {q(os.path.join(outputs_dir, marker))}",
                   ctx.timeout)
    reference = None
    measured = sorted(o for o, _, _ in skews if o is not None)
    middle = measured[(len(measured) - 1) // 2] if measured else 0.0  # the hosts' common time
    rows, problems = [], []
    for i, (r, (offset, err, why)) in enumerate(zip(results, skews)):
        cells = {}
        down = r.failure() or r.field("error")
        if down:
            problems.append(f"{r.host}: {down}")
            rows.append((r.host, down, None, None, None, None, "FAIL"))
            continue
        f = r.fields()
        if offset is None:
            cells["clock"] = (f"not measured ({why})", False)
        else:
            cells["clock"] = (f"{offset:+.3f}s ±{err:.3f}", abs(offset - middle) <= max_skew)
        avail, _, where = (f.get("disk") or [""])[0].partition(" ")
        free = int(avail) / 2 ** 20 if avail.isdigit() else None
        cells["disk"] = (f"{free:.0f} GB free ({where})" if free is not None else "df failed",
                         free is not None and free >= min_free_gb)
        version = (f.get("versions") or [None])[0]
        if version is None:
            cells["versions"] = ((f.get("versions_error") or ["?"])[0], False)
        else:
            reference = reference or version
            cells["versions"] = (version, version == reference)
        cells["port"] = _port(f, is_coord[i], coordinator)
        if "@@made" not in mk.out:
            cells["shared"] = (f"could not write in {outputs_dir} on {ctx.hosts[0]}", False)
        else:
            seen = (f.get("shared") or ["no"])[0] == "yes"
            cells["shared"] = ("yes" if seen else f"no: {outputs_dir} is not {ctx.hosts[0]}'s folder", seen)
        for name, (text, good) in cells.items():
            if not good:
                problems.append(f"{r.host}: {name}: {text}")
        rows.append((r.host, *(t + ("" if g else " !") for t, g in cells.values()),
                     "ok" if all(g for _, g in cells.values()) else "FAIL"))
    if abs(middle) > max_skew:
        print(f"note: this machine's clock is {-middle:+.3f}s off the hosts' (not a problem for the run)")
    print(format_table(("host", "clock vs here", "disk (outputs)", "versions", f"port {coordinator}",
                        "shared outputs", "result"), rows))
    for p in problems:
        print("FAIL " + p)
    if any("clock" in p for p in problems):
        print(f"clocks {measured[-1] - measured[0]:.3f}s apart (limit {max_skew}s): the hosts' time sync "
              f"(chrony/NTP) is off; a clock stepped or slewed under a running job breaks NCCL and "
              f"jax.distributed timeouts. Fix the time sync first.")
    print("preflight: " + ("all checks passed" if not problems else f"{len(problems)} problem(s)"))
    return 1 if problems else 0
