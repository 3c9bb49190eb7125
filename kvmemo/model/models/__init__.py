"""The architectures: the registry (registry.py), the Llama family (llama.py), Gemma 3
(gemma3.py), LLaVA (llava.py, around vision.py's CLIP tower; image_processor.py prepares its
pixels), the plain attention the model tests use (dense_attention.py), and the Llama fast paths
bound from outside the model class (llama_fast.py). Imports layers/ and kernels/, never loading/."""
