"""Benchmarks and quality measurements: scripts that print tables, never gate CI."""
