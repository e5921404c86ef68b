"""The base of every config section: strict pydantic models whose errors name the key path."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


def _integral(value: Any) -> Any:
    # JSON configs routinely write counts and sizes as 5e8; accept a float only when it is whole.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_integral)]
PositiveInt = Annotated[int, BeforeValidator(_integral), Field(gt=0)]
NonNegativeInt = Annotated[int, BeforeValidator(_integral), Field(ge=0)]


class StrictModel(BaseModel):
    """A config section: unknown keys and wrongly typed values are errors, never ignored.

    `not_supported_until` names the fields that are real DeepSpeed keys but not honoured, with the
    reason shown to the user: such a field may be written only with its default value; anything else is
    refused as "not supported yet" by the loader, so no key is ever accepted and silently ignored.
    A section may instead list the fields it does honour in `implemented`; every other field is then
    treated the same way. `key_hints` maps a key that is
    not a field (a common mistake) to the advice shown when it appears, e.g. `max_grad_norm` in
    optimizer params -> "use the top-level gradient_clipping". `tuning_notes` are honoured fields
    whose every value leaves shardspeed doing the same thing, with the note that says what.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, validate_default=True)

    implemented: ClassVar[frozenset[str] | None] = None
    not_supported_until: ClassVar[dict[str, str]] = {}
    key_hints: ClassVar[dict[str, str]] = {}
    # Layout and speed settings whose intent shardspeed meets whatever their value: the note says
    # what shardspeed does; the start-up report shows it when the value is not the default.
    tuning_notes: ClassVar[dict[str, str]] = {}

    @classmethod
    def unsupported_reason(cls, field: str) -> str | None:
        """Why `field` may not be set (shown to the user), or None if it is honoured."""
        if field in cls.not_supported_until:
            return cls.not_supported_until[field]
        if cls.implemented is not None and field not in cls.implemented:
            return "not built in shardspeed"
        return None
