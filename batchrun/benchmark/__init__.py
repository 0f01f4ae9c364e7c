"""The job=benchmark throughput benchmark: batchrun against HF transformers `generate` on one workload
in one process (throughput.py, run by the cli), with its config, workloads, HF side, job path,
report and the docs-section writer. Installed with the package so `python -m batchrun job=benchmark`
runs anywhere; every other benchmark lives in the repository's benchmarks/ folder."""
