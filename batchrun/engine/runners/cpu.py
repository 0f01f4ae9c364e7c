"""The CPU runner: every step eager and synchronous, its tokens on the host when `execute` returns.

No CUDA graphs and no step run ahead: a CPU forward pays no launch overhead for a graph to save,
and nothing overlaps the host's bookkeeping with it. The step itself is the base's
(runners/base.py): the forward, then grammar masks, draft verification and the sampler.
"""

from __future__ import annotations

from batchrun.engine.runners.base import ModelRunner


class CpuRunner(ModelRunner):
    """ModelRunner's synchronous step, chosen at start-up for a CPU device (engine/startup.py)."""
