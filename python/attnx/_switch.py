"""A process-wide switch turned on for a ``with`` block: what ``attnx.sdpa.enabled`` and
``attnx.flex.enabled`` share."""

import contextlib
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def while_on(is_on: Callable[[], bool], turn_on: Callable[[], None],
             turn_off: Callable[[], None]) -> Iterator[None]:
    """Turns the switch on for the block, then back off unless it was on before."""
    was_on = is_on()
    turn_on()
    try:
        yield
    finally:
        if not was_on:
            turn_off()
