"""Llama-family model (and LLaVA: CLIP vision tower + projector around it): GGUF/safetensors
loading, layers, image preprocessing, and a KV-cache-agnostic forward.

Never imports engine/, kv/ or attention/: attention arrives as a callable (llama.AttentionFn).
"""
