"""Llama-family model: GGUF/safetensors loading, layers, and a KV-cache-agnostic forward.

Never imports engine/, kv/ or attention/: attention arrives as a callable (llama.AttentionFn).
"""
