"""The base every section model of a spec shares: strict, frozen, no unknown fields.

Strict because YAML already typed each value (``"2"`` is text, not 2); no unknown fields
because a misspelt field must be an error, not a setting silently left at its default.
"""

from typing import Any, ClassVar

from pydantic import AliasChoices, BaseModel, ConfigDict, model_validator

from corral.spec.values import plain


class Section(BaseModel):
    """Shared config: strict types (YAML already typed the values; "2" is not 2) and no extras."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)

    # Fields kept only for backends that may honour them; reported as warnings.
    _PLACEMENT: ClassVar[tuple[str, ...]] = ()
    # Old SkyServe spellings still read, with a warning; never suggested in "did you mean".
    _LEGACY: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _null_means_not_given(cls, data: Any) -> Any:
        # ``key:`` with nothing after it is YAML null. Users write it to mean "default" (SkyServe
        # reads it that way), so drop it rather than fail with "expected a number, got null".
        # Only for a field this section reads: an empty misspelt key (``replica_polcy:``) or
        # a null key (``? null``) is still the unknown field it is, not silently nothing.
        if isinstance(data, dict):
            known = cls._field_keys()
            # Kept-only fields are stored as plain JSON values (a YAML date becomes its text),
            # so model_dump() of any section can go into the API's JSON as is.
            return {
                k: plain(v) if k in cls._PLACEMENT else v
                for k, v in data.items()
                if v is not None or k not in known
            }
        return data

    @classmethod
    def _field_keys(cls) -> set[str]:
        """Every key this section reads: its fields' names and their other spellings."""
        keys = set(cls.model_fields)
        for info in cls.model_fields.values():
            if isinstance(info.validation_alias, AliasChoices):
                keys.update(str(choice) for choice in info.validation_alias.choices)
        return keys

    def _placement_set(self, prefix: str) -> list[str]:
        return [f"{prefix}{name}" for name in self._PLACEMENT if getattr(self, name) is not None]
