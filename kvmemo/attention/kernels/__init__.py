"""Attention's C kernels beside their loaders (same stem): paged_decode (decode over the pages in
place) and flash_attention (prefill and shared prefixes)."""
