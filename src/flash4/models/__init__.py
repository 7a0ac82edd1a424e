"""CPU models of kernel dataflows: plain torch/NumPy emulations that check an algorithm's numerics
without the GPU it targets (flash4.models.sm100_fwd: the Blackwell forward; flash4.models.sm100_bwd:
its backward). They check the algorithm, not a compiled kernel: the first-use self-test
(flash4.selftest) checks the kernel."""
