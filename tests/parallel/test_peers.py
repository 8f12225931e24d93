"""The peer watch (jaxsora.parallel.peers) ends when asked, after its request in flight: at exit it must be
gone before the interpreter finalizes (a daemon thread returning from jaxlib then aborts a run that
succeeded: `terminate called after throwing an instance of ''`, seen on two-process runs under load)."""
import threading
import time

import pytest

from jaxsora.parallel import peers
from jaxsora.parallel.peers import EXITED, PeerWatch


class SlowStore:
    """A key-value store whose every request takes `delay` seconds; counts the requests begun and ended."""

    def __init__(self, delay: float):
        self.delay, self.begun, self.ended, self.data = delay, 0, 0, {}
        self.first = threading.Event()

    def key_value_set(self, key, value, allow_overwrite=False):
        self.begun += 1
        self.first.set()
        time.sleep(self.delay)
        self.data[key] = value
        self.ended += 1

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.data.items() if k.startswith(prefix)]


@pytest.mark.parametrize("peer_says", ["7", EXITED])
def test_a_still_counter_is_a_loss_and_an_exit_is_not(monkeypatch, peer_says):
    lost = []
    monkeypatch.setattr(peers, "default_handler", lambda who, why: lost.append((who, why)))
    store = SlowStore(delay=0.0)
    store.data["jaxsora/alive/1"] = peer_says  # process 1's word, standing still from the start
    watch = PeerWatch(store, process_id=0, num_processes=2, timeout=0.3, interval=0.02)
    watch.start()
    watch.fired.wait(3.0)
    watch.stop()
    if peer_says == EXITED:  # ended normally: process 0 may take as long as it needs to finish
        assert lost == [] and not watch.fired.is_set()
    else:
        assert lost and all(who == [1] and "no sign of life" in why for who, why in lost)


def test_stop_waits_for_the_request_in_flight_ends_the_watch_and_says_exited():
    store = SlowStore(delay=0.3)
    watch = PeerWatch(store, process_id=1, num_processes=2, timeout=60.0, interval=0.05)
    watch.start()
    assert store.first.wait(10)
    watch.stop()
    assert not watch.is_alive()
    assert store.begun == store.ended >= 1  # nothing left inside the store when stop returned
    assert store.data["jaxsora/alive/1"] == EXITED  # its last word
    begun = store.begun
    time.sleep(0.2)
    assert store.begun == begun and not watch.fired.is_set()


def test_stop_does_not_wait_out_the_interval():
    watch = PeerWatch(SlowStore(delay=0.0), process_id=0, num_processes=2, timeout=600.0, interval=100.0)
    watch.start()
    time.sleep(0.2)  # now in its 100 s wait
    t = time.monotonic()
    watch.stop()
    assert not watch.is_alive() and time.monotonic() - t < 5


class LivePeer(threading.Thread):
    """Process `pid`'s watch as the store sees it: its counter moves every `every` seconds until `stop`, then
    its last word (`last`)."""

    def __init__(self, store, pid, every=0.02, last=None):
        super().__init__(daemon=True)
        self.store, self.pid, self.every, self.last = store, pid, every, last
        self.halt = threading.Event()

    def run(self):
        n = 0
        while not self.halt.wait(self.every):
            n += 1
            self.store.data[f"jaxsora/alive/{self.pid}"] = str(n)
        if self.last is not None:
            self.store.data[f"jaxsora/alive/{self.pid}"] = self.last


@pytest.fixture
def verdicts(monkeypatch):
    """The verdicts the watch reaches (who, why), in place of ending the process."""
    got = []
    monkeypatch.setattr(peers, "default_handler", lambda who, why: got.append((who, why)))
    monkeypatch.setattr(peers, "_handler", None)
    return got


def test_a_peer_that_stopped_for_a_lost_peer_stops_the_others_at_once(verdicts):
    """Process 1 lost process 2 and said so: process 0 stops naming process 2, long before its own timeout, and
    leaves the same word for the rest."""
    store = SlowStore(delay=0.0)
    store.data["jaxsora/alive/1"] = "lost:2"
    store.data["jaxsora/alive/2"] = "5"
    watch = PeerWatch(store, process_id=0, num_processes=3, timeout=60.0, interval=0.02)
    t = time.monotonic()
    watch.start()
    assert watch.fired.wait(5) and time.monotonic() - t < 5
    watch.stop()
    assert verdicts and verdicts[0] == ([2], "process 1 stopped for it")
    assert store.data["jaxsora/alive/0"] == "lost:2"


def test_finish_waits_for_every_peer_to_end(verdicts):
    """At exit (before jax's shutdown barrier) a process waits while its peer still works (its counter moves),
    and goes once the peer said `exited`."""
    store = SlowStore(delay=0.0)
    peer = LivePeer(store, 1, last=EXITED)
    peer.start()
    watch = PeerWatch(store, process_id=0, num_processes=2, timeout=1.0, interval=0.05)
    watch.start()
    threading.Timer(2.0, peer.halt.set).start()  # the peer works on for 2 s, longer than the timeout
    t = time.monotonic()
    watch.finish(limit=30)
    assert 1.8 < time.monotonic() - t < 10 and not verdicts
    assert store.data["jaxsora/alive/0"] == EXITED and not watch.is_alive()


def test_finish_reports_a_peer_lost_at_the_end(verdicts):
    """The peer dies while this process is done: it is named (one line, exit 76) instead of jax's shutdown
    barrier failing for it later."""
    store = SlowStore(delay=0.0)
    peer = LivePeer(store, 1)  # no last word: killed
    peer.start()
    watch = PeerWatch(store, process_id=0, num_processes=2, timeout=0.5, interval=0.05)
    watch.start()
    threading.Timer(0.5, peer.halt.set).start()
    watch.finish(limit=30)
    assert verdicts and verdicts[0][0] == [1] and "no sign of life" in verdicts[0][1]


def test_a_collective_failure_names_a_peer_when_no_process_is_silent(verdicts, monkeypatch):
    """The step's collective failed (the issue's Gloo error) but every peer still counts: once the watch had
    its time, the process stops naming "a peer"."""
    store = SlowStore(delay=0.0)
    peer = LivePeer(store, 1)
    peer.start()
    watch = PeerWatch(store, process_id=0, num_processes=2, timeout=0.3, interval=0.05)
    watch.start()
    monkeypatch.setattr(peers, "_watch", watch)
    error = RuntimeError("UNKNOWN: Gloo all-reduce failed: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
                         "Read error [127.0.0.1]:40631: Connection reset by peer")
    assert peers.is_collective_failure(error)
    t = time.monotonic()
    peers.await_verdict(error)
    peer.halt.set()
    watch.stop()
    assert verdicts and verdicts[0][0] == [] and verdicts[0][1].startswith("a collective failed: UNKNOWN: Gloo")
    assert time.monotonic() - t < 5


def test_an_error_of_its_own_is_not_a_lost_peer(verdicts, monkeypatch):
    store = SlowStore(delay=0.0)
    peer = LivePeer(store, 1)
    peer.start()
    watch = PeerWatch(store, process_id=0, num_processes=2, timeout=0.3, interval=0.05)
    watch.start()
    monkeypatch.setattr(peers, "_watch", watch)
    time.sleep(0.3)
    error = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB")
    assert not peers.is_collective_failure(error)
    peers.await_verdict(error)  # returns at once: the caller re-raises
    assert not peers.settle()  # nobody suspect: the stall watchdog reports at once
    peer.halt.set()
    watch.stop()
    assert not verdicts


def test_the_stall_watchdog_lets_the_watch_speak_first(verdicts, monkeypatch, tmp_path):
    """A step stuck in a collective whose peer went silent: the peer's verdict comes before any stack dump."""
    from jaxsora.train.run.supervise import Watchdog

    store = SlowStore(delay=0.0)
    store.data["jaxsora/alive/1"] = "3"  # counted once, then silent
    watch = PeerWatch(store, process_id=0, num_processes=2, timeout=1.5, interval=0.05)
    monkeypatch.setattr(peers, "_watch", watch)
    order = []
    monkeypatch.setattr(peers, "default_handler", lambda who, why: order.append(("verdict", who)))
    log = open(tmp_path / "log.txt", "w+")
    watch.start()
    dog = Watchdog(factor=10.0, min_seconds=1.0, poll=0.05, stream=log)  # after the peer is suspect (0.6 s)
    dog.phase("step")
    deadline = time.monotonic() + 10
    while not dog.dumps and time.monotonic() < deadline:
        time.sleep(0.05)
    order.append(("dump", dog.dumps[:1]))
    dog.stop()
    watch.stop()
    assert order[0] == ("verdict", [1]), order


def test_the_line_and_the_newest_intact_checkpoint(tmp_path):
    run = tmp_path / "run"
    assert peers.newest_intact(str(run)) is None
    for step, intact in ((2, True), (4, True), (6, False)):
        (run / "checkpoints" / str(step)).mkdir(parents=True)
        if intact:
            (run / "checkpoints" / str(step) / "integrity.json").write_text("{}")
    (run / "checkpoints" / "8.orbax-checkpoint-tmp-3").mkdir()
    assert peers.newest_intact(str(run)) == 4
    line = peers.lost_line([1], 2, 0, "no sign of life for 30 s", 7, str(run), 4)
    assert line == (f"[jaxsora] lost process 1 of 2 (no sign of life for 30 s) at step 7: process 0 stops (exit code "
                    f"76); resume every process with --load {run} (newest intact checkpoint: step 4)")
    assert "lost a peer of 4" in peers.lost_line([], 4, 3, "x", None, str(run), None)
    assert "before its first step" in peers.lost_line([], 4, 3, "x", None, str(run), None)
    assert "no checkpoint was written yet" in peers.lost_line([0], 2, 1, "x", 3, str(run), None)


def test_a_peer_failing_with_its_own_error_stops_the_others_naming_it(verdicts):
    store = SlowStore(delay=0.0)
    store.data["jaxsora/alive/1"] = "failed"
    watch = PeerWatch(store, process_id=0, num_processes=2, timeout=60.0, interval=0.05)
    watch.start()
    assert watch.fired.wait(5)
    watch.stop()
    assert verdicts[0] == ([1], "it stopped with an error: see its log")


def test_a_failing_process_says_so_and_waits_for_nobody(verdicts):
    """Every process failing alike (a user error they all meet): each says `failed`, none takes the others'
    word for a lost peer, and none waits for the others at exit."""
    store = SlowStore(delay=0.0)
    peer = LivePeer(store, 1, last="failed")
    peer.start()
    watch = PeerWatch(store, process_id=0, num_processes=2, timeout=60.0, interval=0.05)
    watch.start()
    time.sleep(0.2)
    watch.failing()
    peer.halt.set()  # the peer fails too
    peer.join()
    assert store.data["jaxsora/alive/0"] == "failed" and not watch.is_alive()
    t = time.monotonic()
    watch.finish(limit=30)
    assert time.monotonic() - t < 1 and store.data["jaxsora/alive/0"] == "failed" and not verdicts
