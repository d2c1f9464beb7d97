"""`python -m hybridmoe.cluster.child PARENT_PID ARGV...`: exec ARGV so that it gets SIGTERM
when the process PARENT_PID dies (Linux's parent-death signal, kept across exec). The
supervisor starts its replicas and the router through this: no preexec_fn (unsafe once the
supervisor runs threads), and a killed supervisor leaves no child behind."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    parent_pid, command = int(argv[0]), argv[1:]
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        sys.exit(1)
    os.execv(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
