"""Test hooks for real worker processes (tests/job/test_exactly_once.py, tests/job/test_chaos.py).

Loaded by every Python process whose PYTHONPATH holds this directory; inert unless
BATCHRUN_TEST_HOOKS holds a JSON object:
    dir        a directory for the files below (optional)
    delay_s    sleep after each output row (so that kills and stops land mid-shard)
    die_on     shard names on which this process SIGKILLs itself after its first output (an OOM)
    rank       a label for the files
    store_outage_on, store_outage_s
               a shard name and seconds: at that shard's first output, the store goes out of reach
               for this process's claim heartbeat: its next write of that shard's claim hangs for
               store_outage_s and then fails (once, so make it longer than the lease), and the
               shard's outputs wait until the heartbeat has found its claim lost
    s3fs_without_create_mode   s3fs behaves as before 2024.12: pipe_file takes no `mode` and passes
               it on as a keyword that botocore drops, so a "create" silently overwrites
    retry_base_delay_s         the store's first retry backoff (batchrun.job.commit.directory.RETRY_BASE_DELAY_S)
    metrics_interval_s         the least time between metrics textfile rewrites
               (batchrun.job.operate.textfile.INTERVAL_S)
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
    from batchrun.job.run import flow as _flow

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

# Checkpoint hooks (tests/job/commit/test_checkpoints.py), also off unless BATCHRUN_TEST_HOOKS names them:
#    record            append each output's input row index to {dir}/outputs-{pid}
#    kill_after        SIGKILL this process after that many outputs
#    kill_at           SIGKILL at a point of the commit protocol, the kill_at_count-th time (from 1):
#                      part_written (part files written, marker not created), part_committed
#                      (marker created), merge (the shard's results file half written),
#                      marker_created (shard marker created, files not published)
if _spec:
    from batchrun.job.commit import checkpoints as _checkpoints
    from batchrun.job.commit import store as _store

    _outputs = {"n": 0}
    _points: dict = {}
    _record = open(_dir / f"outputs-{os.getpid()}", "a", buffering=1) if _cfg.get("record") else None

    def _at(point, before_kill=None):
        _points[point] = _points.get(point, 0) + 1
        if _cfg.get("kill_at") == point and _points[point] == int(_cfg.get("kill_at_count", 1)):
            if before_kill is not None:
                before_kill()
            os.kill(os.getpid(), signal.SIGKILL)

    _hooked_on_output = _flow.ShardRun.on_output

    def _on_output_recorded(self, out):
        _hooked_on_output(self, out)
        if _record is not None:
            _record.write(f"{out.request_id[1]}\n")
        _outputs["n"] += 1
        if _cfg.get("kill_after") is not None and _outputs["n"] >= int(_cfg["kill_after"]):
            os.kill(os.getpid(), signal.SIGKILL)

    _flow.ShardRun.on_output = _on_output_recorded

    _real_create_decided = _checkpoints.ShardOutput._create_decided

    def _create_decided(self, path, doc):
        _at("part_written")
        won = _real_create_decided(self, path, doc)
        _at("part_committed")
        return won

    _checkpoints.ShardOutput._create_decided = _create_decided

    _real_merge = _checkpoints.ShardOutput._merge_results

    def _merge_results(self, chunks, memory):
        real_open = self.store.fs.open

        def open_then_kill(path, mode="rb", **kw):
            f = real_open(path, mode, **kw)
            if "w" in mode and path == self.attempt.results_tmp:

                def torn():  # the kill leaves the file half written
                    f.write(b"PAR1")
                    f.flush()

                _at("merge", torn)
            return f

        self.store.fs.open = open_then_kill
        try:
            return _real_merge(self, chunks, memory)
        finally:
            del self.store.fs.open

    _checkpoints.ShardOutput._merge_results = _merge_results

    _real_publish = _store.RunStore.publish

    def _publish(self, shard, marker):
        _at("marker_created")
        return _real_publish(self, shard, marker)

    _store.RunStore.publish = _publish

    _outage_on = _cfg.get("store_outage_on")
    if _outage_on:
        import threading

        from batchrun.job.commit import store as _store

        _outage = threading.Event()  # set: the next write of the shard's claim hangs, then fails
        _outages = []  # the one outage, once it happened: the shard taken back runs normally
        _real_write_json = _store.RunStore.write_json

        def _write_json(self, path, obj):
            if f"/_claims/{_outage_on}/" in path and _outage.is_set():
                _outage.clear()
                time.sleep(float(_cfg["store_outage_s"]))
                raise OSError(f"the store is out of reach (test hook): writing {path}")
            return _real_write_json(self, path, obj)

        _store.RunStore.write_json = _write_json
        _on_output_before_outage = _flow.ShardRun.on_output

        def _on_output_with_outage(self, out):
            first = not getattr(self, "_outage_hooked", False)
            self._outage_hooked = True
            if first and self.shard.name == _outage_on and not _outages:
                _outages.append(self.shard.name)
                _outage.set()
                deadline = time.monotonic() + 120
                while not self.claims.is_lost(self.shard.name) and time.monotonic() < deadline:
                    time.sleep(0.05)
            _on_output_before_outage(self, out)

        _flow.ShardRun.on_output = _on_output_with_outage
    if "retry_base_delay_s" in _cfg:
        from batchrun.job.commit import directory as _directory

        _directory.RETRY_BASE_DELAY_S = float(_cfg["retry_base_delay_s"])
    if "metrics_interval_s" in _cfg:
        from batchrun.job.operate import textfile as _textfile

        _textfile.INTERVAL_S = float(_cfg["metrics_interval_s"])

    if _cfg.get("s3fs_without_create_mode"):
        import s3fs

        _real_pipe_file = s3fs.S3FileSystem._pipe_file

        async def _pipe_file(self, path, data, chunksize=50 * 2**20, max_concurrency=None, **kwargs):
            kwargs.pop("mode", None)  # what botocore's keyword filter did with it
            return await _real_pipe_file(self, path, data, chunksize, max_concurrency, **kwargs)

        s3fs.S3FileSystem._pipe_file = _pipe_file
