"""Test hooks for real worker processes (tests/test_exactly_once.py, tests/test_chaos.py).

Loaded by every Python process whose PYTHONPATH holds this directory; inert unless
BATCHRUN_TEST_HOOKS holds a JSON object:
    dir        a directory for the files below (optional)
    delay_s    sleep after each output row (so that kills and stops land mid-shard)
    die_on     shard names on which this process SIGKILLs itself after its first output (an OOM)
    rank       a label for the files
    s3fs_without_create_mode   s3fs behaves as before 2024.12: pipe_file takes no `mode` and passes
               it on as a keyword that botocore drops, so a "create" silently overwrites
    retry_base_delay_s         the store's first retry backoff (batchrun.job.store.RETRY_BASE_DELAY_S)
Each shard this process starts writes {dir}/started-{rank}-{shard}-{pid} at its first output
(with shards open side by side, several may have started).
"""

import json
import os

_spec = os.environ.get("BATCHRUN_TEST_HOOKS")
if _spec:
    import pathlib
    import signal
    import time

    _cfg = json.loads(_spec)
    _dir = pathlib.Path(_cfg["dir"]) if _cfg.get("dir") else None
    from batchrun.job import flow as _flow

    _real_on_output = _flow.ShardRun.on_output

    def _on_output(self, out):
        _real_on_output(self, out)
        first = not getattr(self, "_hooked", False)
        self._hooked = True
        if first:
            if _dir is not None:
                (_dir / f"started-{_cfg.get('rank', 'x')}-{self.shard.name}-{os.getpid()}").touch()
            if self.shard.name in _cfg.get("die_on", ()):
                os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(float(_cfg.get("delay_s", 0)))

    _flow.ShardRun.on_output = _on_output

    if "retry_base_delay_s" in _cfg:
        from batchrun.job import store as _store

        _store.RETRY_BASE_DELAY_S = float(_cfg["retry_base_delay_s"])

    if _cfg.get("s3fs_without_create_mode"):
        import s3fs

        _real_pipe_file = s3fs.S3FileSystem._pipe_file

        async def _pipe_file(self, path, data, chunksize=50 * 2**20, max_concurrency=None, **kwargs):
            kwargs.pop("mode", None)  # what botocore's keyword filter did with it
            return await _real_pipe_file(self, path, data, chunksize, max_concurrency, **kwargs)

        s3fs.S3FileSystem._pipe_file = _pipe_file
