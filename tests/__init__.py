"""The test suite, in folders that mirror the package (engine/, kernels/, model/, job/, utils/) and
benchmarks/ (the repository's benchmarks/ and batchrun/benchmark/); whole-repository checks stay
here. Every folder is a package, so test modules are named by their path (tests.job.test_samples,
tests.engine.test_samples) and may share a basename; scaffolding shared across folders is in
tests/support/."""
