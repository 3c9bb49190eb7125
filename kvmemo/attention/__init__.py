"""Attention over the paged KV cache: the backend the model calls per layer (backend.py), the
page layout and K/V writes (cache.py, fp8.py), paged prefill and decode (paged.py), shared-prefix
cascade attention and its log-sum-exp merges (cascade.py, fused_decode.py, prefix_packs.py), chunk
blending (blend.py), the plain reference every faster path is tested against (torch_ref.py), and
the C kernels beside their loaders (kernels/). Receives metadata; never imports the scheduler."""
