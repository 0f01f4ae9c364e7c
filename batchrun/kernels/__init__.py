"""Compute kernels, as functions over tensors: plain-torch references, native CPU kernels (csrc/,
kernels/cpu_native.py) and Triton kernels for the GPU, and the kernel set that binds one of them per
kernel for the device target, once, at start-up (target.py, binding.py, kernel_set.py, tuning.py).
The nn.Modules that hold weights for them live in batchrun.model. See docs/kernels.md."""
