"""The cycle collector during a long run: objects alive before it are not walked, what the run
makes is collected, and the caller's setting is as it was afterwards."""

import gc
import weakref

from torchparity.collector import older_objects_frozen, with_older_objects_frozen


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_objects_alive_before_are_frozen_and_new_garbage_is_collected():
    assert gc.get_freeze_count() == 0
    with older_objects_frozen():
        assert gc.get_freeze_count() > 10_000  # the interpreter's and torch's objects
        frozen = gc.get_freeze_count()
        made = [weakref.ref(Node()) for _ in range(1000)]
        gc.collect()
        assert all(ref() is None for ref in made)  # the run's own cycles are freed
        # Nothing made since is frozen (a frozen object may still die: a thread of the test
        # runner frees its own), and nothing was unfrozen.
        assert 0 < gc.get_freeze_count() <= frozen
        with older_objects_frozen():  # a diagnosis inside a command: the command froze
            pass
        assert 0 < gc.get_freeze_count() <= frozen
    assert gc.get_freeze_count() == 0


def test_a_caller_that_froze_or_disabled_the_collector_keeps_its_setting():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with older_objects_frozen():
            Node()
        assert 0 < gc.get_freeze_count() <= frozen  # neither frozen again nor unfrozen
    finally:
        gc.unfreeze()
    gc.disable()
    try:
        with older_objects_frozen():
            assert gc.get_freeze_count() == 0
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_decorated_function_unfreezes_after_an_error():
    @with_older_objects_frozen
    def fails() -> None:
        assert gc.get_freeze_count() > 0
        raise ValueError("boom")

    try:
        fails()
    except ValueError:
        pass
    assert gc.get_freeze_count() == 0
