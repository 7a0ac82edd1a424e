"""The sm90 (Hopper, sm_90a) kernel family: TMA, wgmma, warp-specialized forward and backward.

Registered in flash4.kernels.registry (pass "fwd" -> fwd.FlashAttentionForwardSm90, "bwd" ->
bwd.FlashAttentionBackwardSm90); configs in flash4.config.sm90.
"""
