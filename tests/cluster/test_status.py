"""status: nvidia-smi CSV parsed into a per-host table (fake nvidia-smi), trainer state from
pids.json, step and heartbeat age from the run's heartbeat files."""
import json
import os
import subprocess
import time

from jaxsora.cluster import records
from jaxsora.cluster.status import parse_apps, parse_gpus
from jaxsora.train.run.supervise import _proc_start, write_heartbeat

GPUS_A = """0, NVIDIA H100 80GB HBM3, 61234, 81559, 697.50, 1980, 1980, 0, 63, 100
1, NVIDIA H100 80GB HBM3, 61000, 81559, 690.25, 1755, 1980, 2, 65, 98"""
GPUS_B = """0, NVIDIA A10G, 100, 23028, [N/A], 210, 1710, [N/A], 30, 0"""


def test_parse_nvidia_smi():
    gpus, err = parse_gpus(GPUS_A.splitlines() + [""])
    assert err is None and [g["index"] for g in gpus] == [0, 1]
    assert gpus[1]["mem_used"] == 61000 and gpus[1]["power"] == 690.25 and gpus[1]["ecc"] == 2
    gpus, err = parse_gpus(GPUS_B.splitlines())
    assert gpus[0]["power"] is None and gpus[0]["ecc"] is None and gpus[0]["sm_clock_max"] == 1710
    gpus, err = parse_gpus(["NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."])
    assert gpus == [] and err.startswith("NVIDIA-SMI has failed")
    assert parse_apps(["4242, 61000", "4242, 100", "4243, [N/A]", ""]) == [4242, 4243]


def test_status_table(cluster, capsys):
    hosts = cluster.hosts("gpu-a", "gpu-b", "nogpu", "broken", nvidia=False)
    cluster.nvidia("gpu-a", GPUS_A, "4242, 61000\n4243, 60000")
    cluster.nvidia("gpu-b", GPUS_B, "")
    cluster.tool("broken", "nvidia-smi", "#!/bin/sh\necho \"NVIDIA-SMI has failed because it couldn't "
                 "communicate with the NVIDIA driver.\"\nexit 9\n")
    gone = subprocess.Popen(["true"])
    gone.wait()
    os.makedirs(cluster.logdir)
    records.write_pids(cluster.logdir, dict(run=cluster.run, hosts=[
        dict(host="gpu-a", process=0, pid=os.getpid(), start=_proc_start(os.getpid())),
        dict(host="gpu-b", process=1, pid=gone.pid, start="1")]))
    with open(os.path.join(cluster.logdir, "gpu-b.exit"), "w") as f:
        f.write("1\n")
    write_heartbeat(cluster.run, 0, 1200)
    write_heartbeat(cluster.run, 1, 1100)
    hb0 = os.path.join(cluster.run, "heartbeat", "0.json")
    info = json.load(open(hb0))
    info["time"] = time.time() - 2000
    json.dump(info, open(hb0, "w"))

    rc = cluster.cli(hosts, "status")
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = {line.split()[0]: line for line in out.splitlines()[2:6]}
    a = rows["gpu-a"].split()
    # host gpus procs util mem W/gpu SM ECC trainer(pid alive) step heartbeat
    assert a[1:8] == ["2", "2", "99%", "119/159", "694", "1755-1980", "2"], rows["gpu-a"]
    assert a[8:11] == [str(os.getpid()), "alive", "1200"] and 2000 <= int(a[11][:-1]) < 2060, rows["gpu-a"]
    b = rows["gpu-b"].split()
    assert b[1:8] == ["1", "0", "0%", "0/22", "-", "210", "-"], rows["gpu-b"]
    assert f" {gone.pid} exited 1 (crashed: see its log) " in rows["gpu-b"]
    assert b[-2] == "1100" and int(b[-1][:-1]) < 60, rows["gpu-b"]
    assert "no nvidia-smi" in rows["nogpu"]
    assert "NVIDIA-SMI has failed" in rows["broken"]
    assert "gpu-a: 2 uncorrected ECC errors" in out
    assert "gpu-b: the trainer exited (code 1) while others run" in out
    assert "gpu-a: no heartbeat for 20" in out and "(step 1200): hung? `dump` shows its stacks" in out
    assert "steps differ between hosts (1100..1200)" in out

    assert cluster.cli(hosts, "status", "--json") == 0
    js = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert js[0]["gpu_pids"] == [4242, 4243] and js[0]["step"] == 1200 and js[2]["nvidia_smi"] == "missing"


def test_unreachable_host_is_a_row(cluster, capsys, monkeypatch):
    hosts = cluster.hosts("gpu-a", "down")
    monkeypatch.setenv("FAKE_SSH_DOWN", "down")
    assert cluster.cli(hosts, "status") == 1
    out = capsys.readouterr().out
    assert "unreachable: ssh: connect to host down port 22: Connection refused" in out
    assert "(no run folder" in out


def test_phase_before_the_first_step_and_what_an_exit_code_means(cluster, capsys):
    """A trainer still compiling shows its phase instead of a step (and a stale one is named by
    it); a trainer that exited shows what its code means (75: stopped, resume with --load)."""
    hosts = cluster.hosts("h0", "h1", nvidia=False)
    os.makedirs(cluster.logdir)
    gone = subprocess.Popen(["true"])
    gone.wait()
    records.write_pids(cluster.logdir, dict(run=cluster.run, hosts=[
        dict(host="h0", process=0, pid=os.getpid(), start=_proc_start(os.getpid())),
        dict(host="h1", process=1, pid=gone.pid, start="1")]))
    with open(os.path.join(cluster.logdir, "h1.exit"), "w") as f:
        f.write("75\n")
    write_heartbeat(cluster.run, 0, None, phase="compiling")
    write_heartbeat(cluster.run, 1, 40)
    assert cluster.cli(hosts, "status") == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines()[2:4]}
    assert rows["h0"].split()[-2] == "compiling", rows["h0"]
    assert f"{gone.pid} exited 75 (stopped: --load resumes)" in rows["h1"], rows["h1"]
    assert cluster.cli(hosts, "status", "--stale", "0") == 0
    assert "h0: no heartbeat for 0s (compiling)" in capsys.readouterr().out


def test_a_lost_process_is_named_with_its_host_and_time(cluster, capsys):
    """The survivors' heartbeats (phase "lost-peer", written as they stop) say which process was lost; its own
    last heartbeat or the launch record gives its host."""
    hosts = cluster.hosts("h0", "h1", "h2", nvidia=False)
    os.makedirs(cluster.logdir)
    gone = subprocess.Popen(["true"])
    gone.wait()
    records.write_pids(cluster.logdir, dict(run=cluster.run, hosts=[
        dict(host=h, process=i, pid=gone.pid, start="1") for i, h in enumerate(("h0", "h1", "h2"))]))
    for i, h in enumerate(("h0", "h1", "h2")):
        with open(os.path.join(cluster.logdir, f"{h}.exit"), "w") as f:
            f.write("137\n" if i == 1 else "76\n")
    write_heartbeat(cluster.run, 1, 40)
    for i in (0, 2):
        write_heartbeat(cluster.run, i, 41, phase="lost-peer", lost=[1], newest_checkpoint=40)
    assert cluster.cli(hosts, "status") == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines()[2:5]}
    assert "exited 76 (another process was lost: --load resumes)" in rows["h0"], rows["h0"]
    assert "exited 137 (killed (SIGKILL or out of memory))" in rows["h1"], rows["h1"]
    beat = json.load(open(os.path.join(cluster.run, "heartbeat", "0.json")))
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(beat["time"]))  # when process 0 stopped
    lines = [ln for ln in out.splitlines() if "lost process" in ln]
    assert len(lines) == 1, out
    assert lines[0].startswith(f"warning: lost process 1 (host h1) at {when}"), lines[0]
    assert lines[0].endswith("(step 41); h0, h2 stopped (exit code 76); --load resumes from step 40"), lines[0]
