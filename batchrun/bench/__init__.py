"""Benchmarks and quality measurements, never gating CI: the job=benchmark throughput benchmark
(throughput.py, run by the cli), the scripts run with `python -m` (gpu, quant, speculative, moe) and
the library modules they and the tests share (workloads, timing, hf_baseline, cases, quality, doc)."""
