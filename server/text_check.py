"""Client text must be valid Unicode: JSON may carry a lone surrogate ("\\ud800"), which Python
keeps in a str but no tokenizer, msgpack frame or UTF-8 response can carry. Found here, it is
the client's 400 instead of a crash deep inside. Shared by the router and the API server."""
from typing import Any

from pydantic import BaseModel

_MAX_DEPTH = 64  # JSON nested deeper than this is refused before it is walked


def _is_lone_surrogate_text(text: str) -> int:
    """Index of the first surrogate code point in `text`, or -1 (a str from JSON holds pairs
    already combined, so any surrogate left is a lone one)."""
    try:
        text.encode("utf-8")
        return -1
    except UnicodeEncodeError as exc:
        return exc.start


def find_invalid_text(value: Any, path: str = "", depth: int = 0) -> str | None:
    """A description of the first string in `value` (str / list / dict / pydantic model, nested)
    that is not valid Unicode, or of nesting deeper than the limit; None when all is well."""
    if depth > _MAX_DEPTH:
        return f"{path or 'body'}: JSON nested deeper than {_MAX_DEPTH} levels"
    if isinstance(value, str):
        at = _is_lone_surrogate_text(value)
        if at < 0:
            return None
        return (f"{path or 'body'}: invalid Unicode: lone surrogate U+{ord(value[at]):04X} at character {at}; "
                f"send UTF-8 text (escape pairs as \\ud83d\\ude00, never one half alone)")
    if isinstance(value, BaseModel):
        items = list(value.__dict__.items()) + list((value.__pydantic_extra__ or {}).items())
    elif isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        if all(type(v) is int for v in value):
            return None  # token ids: nothing to check
        items = list(enumerate(value))
    else:
        return None
    for key, item in items:
        if isinstance(key, str):
            bad = find_invalid_text(key, path, depth + 1)
            if bad is not None:
                return bad
        child = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)
        bad = find_invalid_text(item, child, depth + 1)
        if bad is not None:
            return bad
    return None


def printable(text: str) -> str:
    """`text` safe to put in a UTF-8 response (a client's lone surrogate becomes `\\ud800`)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
