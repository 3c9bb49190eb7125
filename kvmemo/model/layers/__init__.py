"""Layers a decoder is built of: norms, RoPE, the MLP and the callable types (basic.py), linear
products on the kernel probed per machine (linear.py, linear_probe.py), native GGUF weights
(native_linear.py) and the greedy head (greedy_head.py). Imports kernels/, never models/."""
