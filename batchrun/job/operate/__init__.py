"""What an operator watches and reads: a worker's progress bar and Prometheus textfile, each
shard's metrics row, the end-of-run summary, and a run's status and report read from its store."""
