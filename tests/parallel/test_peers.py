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
