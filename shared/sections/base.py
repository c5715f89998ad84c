"""The base of every config section (`Section`) and `D`, the one-line description each field
carries (shown by ``streamrl config explain``). Imported by every module of `shared.sections`
and by `shared.run_config`.
"""

from __future__ import annotations

import msgspec
from msgspec import Meta


def D(text: str) -> Meta:
    """A field's one-line description: ``Annotated[int, D("rollouts per prompt")]``."""
    return Meta(description=text)


class Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A config section: keyword-only fields, and an unknown key is an error (`shared.config`
    names it and the nearest known one)."""
