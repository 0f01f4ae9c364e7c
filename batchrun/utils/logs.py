"""A log handler that writes to whatever `sys.stderr` is when a record is emitted.

`logging.StreamHandler(sys.stderr)` keeps the stream object it was given. When batchrun's CLI runs
in-process (a notebook, a test, a scheduler calling `batchrun.cli.main`), `sys.stderr` is often
replaced later (Jupyter's per-cell streams, pytest's capture) and the old object closed, after
which every log line turns into a '--- Logging error ---' traceback. This handler looks
`sys.stderr` up on each record instead, like `logging.lastResort` does. It also redacts every
record (utils/redact.py): log lines name URLs and storage options, and job logs are shared.
"""

from __future__ import annotations

import logging
import sys

from batchrun.utils.redact import RedactFilter


class StderrHandler(logging.StreamHandler):
    """StreamHandler bound to the current `sys.stderr` rather than the one at construction."""

    def __init__(self, level: int = logging.NOTSET) -> None:
        logging.Handler.__init__(self, level)
        self.addFilter(RedactFilter())

    @property  # type: ignore[override]
    def stream(self):  # noqa: D401 - logging.StreamHandler reads and flushes self.stream
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:  # setStream() and StreamHandler.__init__ assign it; ignore
        pass
