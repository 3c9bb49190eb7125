"""Structured output: constrain a request's tokens to a JSON schema, regex, choice or grammar.

params.py holds what a request asks for (no torch, no grammar library); grammar.py compiles it
with xgrammar and gives the sampler one token mask per constrained row.
"""

from kvmemo.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
