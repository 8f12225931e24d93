"""The peer watch (jaxsora.parallel.peers) ends when asked, after its request in flight: at exit it must be
gone before the interpreter finalizes (a daemon thread returning from jaxlib then aborts a run that
succeeded: `terminate called after throwing an instance of ''`, seen on two-process runs under load)."""
import threading
import time

from jaxsora.parallel.peers import PeerWatch


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


def test_stop_waits_for_the_request_in_flight_and_ends_the_watch():
    store = SlowStore(delay=0.3)
    watch = PeerWatch(store, process_id=1, num_processes=2, timeout=60.0, interval=0.05)
    watch.start()
    assert store.first.wait(10)
    watch.stop()
    assert not watch.is_alive()
    assert store.begun == store.ended >= 1  # nothing left inside the store when stop returned
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
