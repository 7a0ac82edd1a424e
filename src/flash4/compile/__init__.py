"""Compiling flash4's CuTe DSL kernels: fake tensors, the compile cache, the CPU compile check."""
