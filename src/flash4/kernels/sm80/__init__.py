"""The sm80 (portable) kernel family: warp-level mma.sync m16n8k16, ldmatrix and cp.async, compiled
per target for sm_80, sm_86, sm_89, sm_120a, and sm_90a (for testing on Hopper).

Registered in flash4.kernels.registry (pass "fwd" -> fwd.FlashAttentionForwardSm80); configs in
flash4.config.sm80; design in docs/design/sm80_family.md.
"""
