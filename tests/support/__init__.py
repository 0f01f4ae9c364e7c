"""Scaffolding the test folders share, written once: a case run in Triton's interpreter and on a GPU
(interpreted.py), tiny engines (engines.py), the sampler tests' references and step kinds
(sampling.py), a torch mode that finds host syncs (host_sync.py), an S3 proxy that loses replies
(s3_fault_proxy.py). Fixtures that need pytest's scoping are in tests/conftest.py."""

from pathlib import Path

# The repository root: tests find conf/, jobs/, notebooks/ and docs/ from it, wherever they sit.
REPO = Path(__file__).resolve().parents[2]
