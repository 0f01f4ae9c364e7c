"""Compute kernels, as functions over tensors: plain-torch references, native CPU kernels (csrc/,
kernels/cpu_native.py) and Triton kernels for the GPU, each dispatch choosing among them per call.
The nn.Modules that hold weights for them live in batchrun.model. See docs/kernels.md."""
