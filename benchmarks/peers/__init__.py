"""Peer engines: setup scripts for their own virtualenvs, and the GGUF -> HF converter."""
