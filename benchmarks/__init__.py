"""Benchmarks and quality measurements, never gating CI and not installed with the package: run from
the repository root as `python -m benchmarks.NAME` (gpu, quant, speculative, sampling, moe, ...).

Two kinds of module. Scripts (a `__main__` block) measure and print. Library modules (none: cases,
quality, workloads, decode_step, gpu_launches, compile_cases, compile_counts, the gpu_* parts of the
GPU check) build the cases, stand-in graphs and tiny decoders the scripts measure with, and are the
test harness the tests share with them: tests import library modules, never a script. The
job=benchmark throughput benchmark and the helpers the scripts share with it (timing, doc,
hf_baseline) are batchrun.benchmark, in the package."""
