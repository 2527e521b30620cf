import threading
import time

import pytest

from amprl.common.supervise import Supervisor, ThreadDied


def test_a_thread_that_died_is_reported_with_its_cause_and_the_others_are_not_disturbed():
    sup = Supervisor("svc")
    stop = threading.Event()
    sup.start(lambda: stop.wait(10), "steady")

    def bug():
        raise KeyError("no such slot")
    sup.start(bug, "worker")
    deadline = time.monotonic() + 5
    while not sup.failed:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(ThreadDied, match="svc: the worker thread died: KeyError") as died:
        sup.check()
    assert isinstance(died.value.__cause__, KeyError)
    assert sup.threads[0].is_alive()
    stop.set()
    sup.join()


def test_check_is_quiet_while_every_thread_is_fine():
    sup = Supervisor("svc")
    sup.start(lambda: None, "done")
    sup.join()
    sup.check()
