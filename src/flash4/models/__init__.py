"""CPU models of kernel dataflows: plain torch/NumPy emulations that check an algorithm's numerics
without the GPU it targets. flash4.models.sm100_fwd: the Blackwell forward; flash4.models.sm100_bwd:
the Blackwell 1-CTA backward as flash4.kernels.sm100.bwd builds it (host preprocess order of D, the
rounded lse_log2, P's fma and select, dS's sub/mul/mul order, GQA dK/dV chained in TMEM, the dQ
accumulator's add order, sliding windows). They check the algorithm, not a compiled kernel: the
sm100 kernels are compile-verified, not run on hardware; the first-use self-test (flash4.selftest)
checks a kernel on the GPU."""
