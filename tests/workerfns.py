"""Functions the worker-pool tests run in worker processes (importable by spawn)."""

import os
import signal
import time


def square_or_misbehave(x: int) -> int:
    if x == 3:
        time.sleep(60)  # hangs: stopped by the time limit
    if x == 5:
        os.kill(os.getpid(), signal.SIGSEGV)  # a crash in "native code"
    if x == 7:
        raise ValueError("seven is not allowed")
    return x * x


def niceness_or_crash(x: int) -> int:
    if x == 0:
        os.kill(os.getpid(), signal.SIGSEGV)  # its replacement must be lowered too
    return os.nice(0)
