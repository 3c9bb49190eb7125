"""The model's C kernels, each beside the Python file that builds and loads it (same stem):
layer_ops, quant_int8, quant_linear, skinny_linear, greedy_head; bf16.h, gguf_types.h and
vec_exp.h are shared. A missing compiler means None from the loader and the torch path. Imports
nothing of the model above it."""
