"""Block bookkeeping for the paged KV cache: ids, hashes and counts only.

Invariant: this package never imports torch, the model or the engine.
"""
