"""flash4 behind the interfaces frameworks call: `flash4.integrations.sdpa` (PyTorch's
scaled_dot_product_attention flash backend and torch.nn.attention.varlen.varlen_attn, through torch
2.11's flash-attention plug-in registry) and `flash4.integrations.transformers` (a Hugging Face
transformers attention implementation, "f4attn", `register()`). Nothing here is imported by `import flash4`, and nothing
is activated on import: each integration is opt-in.
"""
