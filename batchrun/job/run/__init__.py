"""One worker's run: its plan (plan.py, affinity.py), its books (ledger.py), and its shards through
one engine stream (flow.py, shard_run.py, planner.py), stopped by a signal (signals.py); runner.py
ties them together."""
