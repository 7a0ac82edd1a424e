"""CuTe DSL kernels. Import of this package needs nvidia-cutlass-dsl, not a GPU."""
