"""InputError: bad user input, naming the request field it came from (stdlib only).

Invariant: every check of user input in the library (sampling parameters, prompts, messages,
images, cache_salt, lengths) raises InputError with the field as `param`, so the server reports
it in OpenAI's error body without parsing messages; it is a ValueError for every other caller.
"""

from __future__ import annotations


class InputError(ValueError):
    """Bad input in the named request field (`param`: a top-level field such as "max_tokens")."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
