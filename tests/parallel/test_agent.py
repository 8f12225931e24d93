"""The trainer's parent (jaxsora.train.run.agent): it copies its child's stderr, keeps its exit code, and turns
jaxlib's abort for a lost peer (the C++ termination text, then SIGABRT) into the trainer's one line, exit 76.
The whole chain (a real fork, jaxlib's real abort when process 0 dies) runs in tests/train/test_lost_host.py;
here the parent's loop runs on stand-in children, and the texts are jaxlib 0.10's, as printed in those runs."""
import contextlib
import json
import mmap
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from jaxsora.errors import EXIT_PEER_LOST
from jaxsora.train.run import agent

# jaxlib 0.10.2's last words in process 1 when process 0 (the coordination service) was killed (abridged: the
# preemption notifier's W/E lines, the poll's E line, the F line of client.h:80, the check-failure trace).
COORDINATOR_GONE = textwrap.dedent("""\
    W1128 14:25:48.374682    7719 preemption_sync_manager.cc:147] Failed to retrieve preemption notice from coordination service: UNAVAILABLE: Socket closed
    E1128 14:25:48.374789    7719 coordination_service_agent.cc:289] Polled an error from coordination service (this can be an error from this or another task).
    F1128 14:25:48.374793    7719 client.h:80] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died; see the other task logs for more details. Disable Python buffering, i.e. `python -u`, to be sure to see all the previous output. absl::Status: UNAVAILABLE: Failed to send RPC to coordination service. Either the leader task was preempted/died/restarted unexpectedly or this task is experiencing network issues. Check earlier logs from 1) this task, 2) the leader (usually slice 0 task 0), and 3) cluster scheduler to debug further.
    Additional GRPC error information from remote target coordination_service while calling /xla.coordination.CoordinationService/PollForError:
    :UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:"Socket closed"}
    *** Check failure stack trace: ***
        @     0x7f417ac40634  absl::lts_20260107::log_internal::LogMessage::SendToLog()
    """)  # noqa: E501
# The service's verdict on a task that stopped sending heartbeats (jax's fault-tolerance guide quotes it).
UNHEALTHY = textwrap.dedent("""\
    E0926 17:26:32.075402  157988 coordination_service_agent.cc:332] Polled an error from coordination service (this can be an error from this or another task).
    F0926 17:26:32.075587  157988 client.h:77] Terminating process because the JAX distributed service detected fatal errors. This most likely indicates that another task died; see the other task logs for more details. Disable Python buffering, i.e. `python -u`, to be sure to see all the previous output. absl::Status: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):
    /job:jax_worker/replica:0/task:3
    The tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. preemption, eviction) to debug further.
    """)  # noqa: E501


def test_the_lost_process_is_read_from_jaxlibs_status():
    assert agent.diagnose(COORDINATOR_GONE, me=1) == ([0], "the coordination service it hosts is gone")
    ids, why = agent.diagnose(UNHEALTHY, me=1)
    assert ids == [3] and "stop sending heartbeats" in why
    ids, why = agent.diagnose("F0101 00:00:00.0 1 client.h:80] Terminating process because the JAX distributed "
                              "service detected fatal errors. absl::Status: INTERNAL: something else", me=2)
    assert ids == [] and "INTERNAL: something else" in why  # named "a peer"


@contextlib.contextmanager
def _parent_signals():
    """supervise() installs its forwarding handlers in this (the test's) process: put pytest's back."""
    saved = {name: signal.getsignal(getattr(signal, name)) for name in agent._FORWARD}
    try:
        yield
    finally:
        for name, handler in saved.items():
            signal.signal(getattr(signal, name), handler)


def _board(tmp_path, step=7, me=1, n=2):
    board = mmap.mmap(-1, 4096)
    agent._HEAD.pack_into(board, 0, step, me, n, 0)
    run = str(tmp_path / "run")
    raw = run.encode()
    board[agent._HEAD.size:agent._HEAD.size + len(raw)] = raw
    agent._HEAD.pack_into(board, 0, step, me, n, len(raw))
    return board, run


def _child(code: str):
    """A stand-in trainer: `code` run by python, its stderr a pipe (the read end returned)."""
    r, w = os.pipe()
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=w, stdout=subprocess.DEVNULL)
    os.close(w)
    return proc, r


def test_jaxlibs_abort_becomes_the_one_line(tmp_path, capfd):
    board, run = _board(tmp_path)
    os.makedirs(os.path.join(run, "checkpoints", "4"))
    open(os.path.join(run, "checkpoints", "4", "integrity.json"), "w").write("{}")
    os.makedirs(os.path.join(run, "checkpoints", "6.orbax-checkpoint-tmp-1"))  # unfinished: not named
    text = json.dumps(COORDINATOR_GONE)
    proc, r = _child(f"import os, sys, time; sys.stderr.write('a line of its own\\n'); sys.stderr.flush(); "
                     f"time.sleep(0.6); sys.stderr.write({text}); sys.stderr.flush(); os.abort()")
    with _parent_signals():
        code = agent.supervise(proc.pid, r, board, hold=0.3)
    err = capfd.readouterr().err
    assert code == EXIT_PEER_LOST
    lines = err.splitlines()
    # what came before jaxlib's text is copied; jaxlib's text is not; then the one line
    assert lines[0] == "a line of its own" and len(lines) == 2, lines
    assert lines[1].startswith("[jaxsora] lost process 0 of 2 (the coordination service it hosts is gone) at step 7: "
                               "process 1 stops (exit code 76); resume every process with --load"), lines[1]
    assert "newest intact checkpoint: step 4)" in lines[1]
    kept = open(os.path.join(run, "lost-peer", "1.txt")).read()
    assert "client.h:80] Terminating process" in kept and "exit status 134" in kept
    beat = json.load(open(os.path.join(run, "heartbeat", "1.json")))
    assert beat["phase"] == "lost-peer" and beat["lost"] == [0] and beat["newest_checkpoint"] == 4
    assert beat["step"] == 7


@pytest.mark.parametrize("how,expected", [("sys.exit(3)", 3), ("sys.exit(0)", 0), (f"os._exit({EXIT_PEER_LOST})", 76),
                                          ("os.kill(os.getpid(), 9)", 137), ("os.abort()", 134)])
def test_any_other_end_keeps_its_exit_code_and_every_line(tmp_path, capfd, how, expected):
    """Its own exit code (the SLURM script acts on it), 128 + the signal for a signal (a shell's convention);
    everything it wrote is copied, late by `hold` seconds at most."""
    board, _ = _board(tmp_path)
    proc, r = _child("import os, sys\nfor i in range(3): print(f'line {i}', file=sys.stderr, flush=True)\n" + how)
    with _parent_signals():
        code = agent.supervise(proc.pid, r, board, hold=0.2)
    assert code == expected
    assert capfd.readouterr().err.splitlines() == ["line 0", "line 1", "line 2"]


def test_the_childs_lines_come_through_while_it_runs(tmp_path, capfd):
    board, _ = _board(tmp_path)
    proc, r = _child("import sys, time\nprint('early', file=sys.stderr, flush=True)\ntime.sleep(3)")
    seen = []

    def watch():
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline and not seen:
            out = capfd.readouterr().err
            if out:
                seen.append((out, time.monotonic()))
            time.sleep(0.05)

    t0 = time.monotonic()
    t = threading.Thread(target=watch)
    t.start()
    with _parent_signals():
        assert agent.supervise(proc.pid, r, board, hold=0.3) == 0
    t.join()
    assert seen and seen[0][0] == "early\n" and seen[0][1] - t0 < 2.5  # long before the child ended (3 s)


def test_signals_to_the_parent_reach_the_child_once(tmp_path):
    board, _ = _board(tmp_path)
    proc, r = _child("import signal, sys, time\n"
                     "got = []\n"
                     "signal.signal(signal.SIGTERM, lambda s, f: got.append(s))\n"
                     "print('ready', file=sys.stderr, flush=True)\n"
                     "time.sleep(2)\n"
                     "sys.exit(40 + len(got))")
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()  # while supervise() waits
    with _parent_signals():
        assert agent.supervise(proc.pid, r, board, hold=0.1) == 41


def test_the_board_carries_step_and_run_folder():
    board = mmap.mmap(-1, 4096)
    agent._HEAD.pack_into(board, 0, -1, 3, 4, 0)
    assert agent.read_board(board) == (None, 3, 4, None)
    saved = agent._board
    agent._board = board
    try:
        agent.note_run("/some/run")
        agent.note_step(12)
    finally:
        agent._board = saved
    assert agent.read_board(board) == (12, 3, 4, "/some/run")


def test_a_service_hiccup_then_another_death_is_not_a_lost_peer(tmp_path, capfd):
    """jaxlib's other threads' lines (the service unreachable) hold the output back, but without jaxlib's
    termination text a death by SIGKILL (the OOM killer) stays itself: 137, every line copied."""
    board, _ = _board(tmp_path)
    hiccup = COORDINATOR_GONE.splitlines()[0]
    proc, r = _child(f"import os, sys; sys.stderr.write({json.dumps(hiccup + chr(10))}); sys.stderr.flush(); "
                     f"os.kill(os.getpid(), 9)")
    with _parent_signals():
        assert agent.supervise(proc.pid, r, board, hold=0.2) == 137
    assert capfd.readouterr().err == hiccup + "\n"
