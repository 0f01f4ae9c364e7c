"""SIGTERM/SIGINT as a request to stop: the runner stops admitting, abandons the shard in progress
(uncommitted, so the next run redoes it) and exits through its normal reporting path.

A signal found ignored when the run starts is left ignored (see `StopRequest.__enter__`).

Further signals while the stop is under way are noted and otherwise ignored: a scheduler or an
impatient user that sends SIGTERM twice must not cut the manifest and the claim releases short.
SIGKILL remains the way to stop at once (and costs nothing that a rerun does not redo).
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any, Optional

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    @property
    def exit_code(self) -> int:
        """The shell's convention for death by signal: 128 + its number (130 SIGINT, 143 SIGTERM)."""
        assert self.signum is not None
        return 128 + self.signum

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.signum is None:
            self.signum = signum
            return
        # Not logging: a handler may run inside a logging call, whose lock is not reentrant.
        try:
            os.write(
                2,
                f"batchrun: got {signal.Signals(signum).name} again; already stopping (nothing partial "
                "is committed; SIGKILL stops at once)\n".encode(),
            )
        except OSError:
            pass

    def __enter__(self) -> StopRequest:
        # Handlers can only be set from the main thread; elsewhere (e.g. a notebook worker) the
        # process keeps its own handling and the run is simply not interruptible gracefully.
        # A signal the process found ignored stays ignored, as Python leaves SIGINT when it starts
        # ignored: a shell runs a script's background jobs with SIGINT ignored (the terminal's Ctrl-C
        # is not for them), nohup leaves SIGHUP so; catching it would undo the caller's choice.
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        # Back to exactly what was found (None: a handler not set from Python, which SIG_DFL is closest to).
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}
