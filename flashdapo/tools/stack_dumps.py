"""`kill -USR1 <pid>`: every thread's Python stack on the process's stderr, and the run goes on.

A rank that hangs (a collective one peer never joins, a rendezvous, a filesystem that stopped answering) looks
like every other waiting rank from outside. The command line (`__main__.main`) registers Python's faulthandler
on SIGUSR1 for as long as a command runs: the signal prints where each thread of that process is, written by
the interpreter's C handler (it works while the main thread is blocked inside a C++ collective), and changes
nothing else. Under torchrun, signal the workers, the launcher's children (`pkill -USR1 -P <launcher pid>`),
not the launcher, which SIGUSR1 would end. The stop signals are SIGINT and SIGTERM (distributed/interrupt.py).
"""

from __future__ import annotations

import faulthandler
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def stacks_on_sigusr1() -> Iterator[None]:
    """While the block runs, SIGUSR1 dumps every thread's stack to stderr (fd 2) and returns; afterwards the
    signal's previous handling is restored. Nothing where the platform has no SIGUSR1 or stderr has no file
    descriptor."""
    stderr = sys.__stderr__
    try:
        faulthandler.register(signal.SIGUSR1, file=stderr, all_threads=True, chain=False)
    except (AttributeError, ValueError, OSError):  # no SIGUSR1 (Windows); a stderr without a file descriptor
        yield
        return
    try:
        yield
    finally:
        faulthandler.unregister(signal.SIGUSR1)
