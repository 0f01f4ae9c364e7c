"""The commit protocol: how a shard's files become committed exactly once, whatever races.

The output directory and its create-if-absent (directory.py, store.py), claims (claims.py), the
run's fingerprint fence (fence.py, fingerprint.py), checkpoints inside a shard (checkpoints.py) and
the run's manifest (manifest.py). It knows shards and files, never a worker's plan or the engine.
"""
