"""The attention backends' names, importable without torch (config validates against them)."""

ATTENTION_BACKENDS = ("auto", "paged", "triton", "reference")
