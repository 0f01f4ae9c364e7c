"""Progress over rows: a tqdm bar with output tokens/s and shards done, or nothing in quiet mode,
and the worker's metrics textfile (textfile.py) when output.metrics_textfile is set.

The bar's total grows as each shard is opened, so no shard is read twice just to count rows.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any, Optional

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from batchrun.job.operate.textfile import MetricsTextfile


class Progress:
    def __init__(self, num_shards: int, quiet: bool, textfile: Optional[MetricsTextfile] = None) -> None:
        self._textfile = textfile
        self._num_shards = num_shards
        self._num_shards_done = 0
        self._num_output_tokens = 0
        self._started = time.perf_counter()
        self._bar: Optional[tqdm] = (
            None if quiet else tqdm(total=0, unit="row", desc="batchrun", dynamic_ncols=True, mininterval=0.5)
        )
        self._update_postfix()
        if textfile is not None:
            textfile.write()

    def add_rows(self, num_rows: int) -> None:
        if self._bar is not None:
            self._bar.total += num_rows
            self._bar.refresh()

    def advance(self, num_rows: int, num_output_tokens: int, row: Optional[Mapping[str, Any]] = None) -> None:
        """`row`: the result row this worker just finished (None: rows a committed part holds)."""
        self._num_output_tokens += num_output_tokens
        if self._textfile is not None and row is not None:
            self._textfile.add_row(row)
            self._textfile.maybe_write()
        if self._bar is not None:
            self._update_postfix(refresh=False)
            self._bar.update(num_rows)

    def add_shards(self, num_shards: int) -> None:
        """Shards taken over from other workers (work stealing) join the count."""
        self._num_shards += num_shards
        self._update_postfix()

    def shard_done(self) -> None:
        self._num_shards_done += 1
        self._update_postfix()
        if self._textfile is not None:
            self._textfile.write()

    def _update_postfix(self, refresh: bool = True) -> None:
        if self._bar is None:
            return
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        self._bar.set_postfix_str(
            f"{self._num_output_tokens / elapsed:.1f} tok/s, shards {self._num_shards_done}/{self._num_shards}",
            refresh=refresh,
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    @contextlib.contextmanager
    def logging_redirected(self) -> Iterator[None]:
        """Route log lines through tqdm.write so they do not tear the bar."""
        if self._bar is None:
            yield
            return
        with logging_redirect_tqdm(loggers=[logging.getLogger()]):
            yield
