"""Settings that take one of a few words are typed `Literal[...]`; this is the one place
they are checked: when a config file or --set is read (`allowed`, so the error names the
choices and the closest one) and when a section is built in code (`check_choices`)."""

from __future__ import annotations

import difflib
import functools
import typing
from typing import Any


def choices_of(hint: Any) -> tuple | None:
    """The words a Literal annotation allows (also inside `X | None`); None otherwise."""
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint)
    for option in typing.get_args(hint):
        if typing.get_origin(option) is typing.Literal:
            return typing.get_args(option)
    return None


def not_a_choice(where: str, value: Any, words: tuple) -> str:
    close = difflib.get_close_matches(str(value), [str(w) for w in words], n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{where} must be {'|'.join(map(str, words))}, got {value!r}{hint}"


@functools.cache
def _literal_fields(cls: type) -> tuple[tuple[str, tuple], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((name, words) for name, hint in hints.items() if (words := choices_of(hint)))


def check_choices(section: Any, name: str) -> None:
    """Raise ValueError when a Literal-typed field of `section` (config section `name`)
    holds a word it does not allow."""
    for key, words in _literal_fields(type(section)):
        value = getattr(section, key)
        if value not in words:
            raise ValueError(not_a_choice(f"{name}.{key}", value, words))
