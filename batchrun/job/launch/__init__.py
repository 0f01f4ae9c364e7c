"""Launching a run: run_job (entry.py) runs one worker here, N worker processes (pool.py) or N Ray
actors (ray_launch.py); dry_run.py says what such a launch would do without running it."""
