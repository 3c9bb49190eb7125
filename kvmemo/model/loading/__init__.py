"""From files to a model: load_model (loader.py) reads a GGUF (gguf.py over the header parser
gguf_header.py) or an HF safetensors directory (safetensors.py), builds the architecture the
registry names, and loads the tokenizer (tokenizer.py; a saved one as fast_tokenizer.py's
FastTokenizer, without transformers) whose chats chat_template.py renders. Imports models/,
layers/, kernels/."""
