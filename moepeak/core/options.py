"""The one resolve rule every schedule's options dataclass follows (LLEPOptions, RingDTPOptions):
an options object (None: the defaults) with each keyword that is not None put in its field, then
the dataclass's own checks (__post_init__, run again by dataclasses.replace)."""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Optional


def resolve_options(cls: type, options: Optional[Any], keywords: Mapping[str, Any], names: Iterable[str],
                    article: str = "a") -> Any:
    """`options` of type `cls` (None: cls()) with the keywords that are not None applied.
    A keyword outside `names` is a TypeError naming it; so is an options object of another type
    (the message reads "options must be <article> <cls>")."""
    names = tuple(names)
    unknown = sorted(set(keywords) - set(names))
    if unknown:
        raise TypeError(f"moepeak: {cls.__name__}.resolve takes the keywords {names}, got {unknown}")
    if options is None:
        options = cls()
    elif not isinstance(options, cls):
        raise TypeError(f"moepeak: options must be {article} {cls.__name__} or None, got {type(options).__name__}")
    given = {k: v for k, v in keywords.items() if v is not None}
    return dataclasses.replace(options, **given) if given else options
