"""Test hooks for real worker processes (tests/test_exactly_once.py, tests/test_chaos.py).

Loaded by every Python process whose PYTHONPATH holds this directory; inert unless
BATCHRUN_TEST_HOOKS holds a JSON object:
    dir        a directory for the files below (optional)
    delay_s    sleep after each output row (so that kills and stops land mid-shard)
    die_on     shard names on which this process SIGKILLs itself after its first output (an OOM)
    rank       a label for the files
Each shard this process starts writes {dir}/started-{rank}-{shard}-{pid} at its first output.
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
    from batchrun.engine import Engine
    from batchrun.job import runner as _runner

    _current = {"shard": None}
    _real_run = _runner._ShardRun.run

    def _run(self):
        _current["shard"] = self.shard.name
        return _real_run(self)

    _runner._ShardRun.run = _run
    _real_stream = Engine.stream

    def _stream(self, *args, **kwargs):
        for n, out in enumerate(_real_stream(self, *args, **kwargs)):
            yield out
            shard = _current["shard"]
            if n == 0:
                if _dir is not None:
                    (_dir / f"started-{_cfg.get('rank', 'x')}-{shard}-{os.getpid()}").touch()
                if shard in _cfg.get("die_on", ()):
                    os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(float(_cfg.get("delay_s", 0)))

    Engine.stream = _stream
