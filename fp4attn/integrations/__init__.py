"""Integrations with model libraries (transformers). diffusers needs none: fp4attn.patch()
swaps the torch function its attention processors call."""
