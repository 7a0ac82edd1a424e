"""The sm100 (Blackwell B200, sm_100a) kernel family: TMA, tcgen05 MMAs into tensor memory,
warp-specialized 1-CTA forward. Compile-verified on the CPU, not run on hardware.

Registered in flash4.kernels.registry (pass "fwd" -> fwd.FlashAttentionForwardSm100, family
unverified, served behind flash4.selftest's first-use gate); configs and plans in flash4.config.sm100; design in docs/design/sm100_forward.md.
"""
