"""StructuredOutputsParams: the one constraint a request's output must follow (vLLM's names).

Invariant: a constructed StructuredOutputsParams sets exactly one constraint and each field has
its type; whether the schema, regex or grammar itself is well formed is the compiler's check
(grammar.py), which raises InputError for it when the request is added.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from kvmemo.errors import InputError

_PARAM = "structured_outputs"
_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of:

    json: a JSON schema (a dict, or its JSON text): the output is one instance of it.
    json_object: True: the output is any one JSON object.
    regex: the output matches this regular expression, whole.
    choice: the output is exactly one of these strings.
    grammar: an EBNF grammar (xgrammar's dialect, as vLLM takes it; start rule `root`).
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        chosen = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(chosen) != 1:
            raise InputError(
                _PARAM,
                f"set exactly one of {', '.join(_KINDS)}; got "
                f"{', '.join(chosen) if chosen else 'none'}",
            )
        if self.json is not None:
            _check(isinstance(self.json, (dict, str)), "json must be a JSON schema (object, text)")
            if isinstance(self.json, str):
                try:
                    json.loads(self.json)
                except ValueError as exc:
                    raise InputError(_PARAM, f"json is not valid JSON: {exc}") from None
        _check(isinstance(self.json_object, bool), "json_object must be true or false")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _check(
                value is None or (isinstance(value, str) and bool(value)),
                f"{name} must be a non-empty string",
            )
        if self.choice is not None:
            _check(
                isinstance(self.choice, (list, tuple)) and len(self.choice) > 0
                and all(isinstance(c, str) and c for c in self.choice),
                f"choice must be a non-empty list of non-empty strings, got {self.choice!r}",
            )
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as compact text. A schema keeps its key order: the order of its
        properties is the order the output writes them in."""
        if self.json is not None:
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            return json.dumps(schema, separators=(",", ":"))
        if self.choice is not None:
            return json.dumps(list(self.choice))
        if self.json_object:
            return "object"
        text = self.regex if self.regex is not None else self.grammar
        assert text is not None
        return text

    @property
    def key(self) -> str:
        """What a compiled grammar is cached under: sha256 of the kind and the spec."""
        return hashlib.sha256(f"{self.kind}\0{self.spec}".encode()).hexdigest()


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InputError(_PARAM, message)
