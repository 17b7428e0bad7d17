"""The one error a spec check raises, carrying every problem found, each pinned to a field."""

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from corral.spec.model import ServiceSpec


@dataclass(frozen=True)
class SpecIssue:
    """One problem in a spec, pinned to a field so an editor or a human can jump to it."""

    loc: str
    message: str
    line: int | None = None
    # What to do about it, when there is one clear fix ("did you mean 'min_replicas'?").
    hint: str | None = None

    def format(self, source: str) -> str:
        """Render as ``FILE:LINE: loc: message``, the shape compilers use and editors parse."""
        where = source
        if self.line is not None:
            where = f"{source}:{self.line}" if source else f"line {self.line}"
        parts = [p for p in (where, self.loc, self.message) if p]
        text = ": ".join(parts)
        return f"{text}; {self.hint}" if self.hint else text

    def as_json(self) -> dict[str, Any]:
        """The shape of ``corral validate --json`` and of the API's error issues."""
        return {"field": self.loc, "line": self.line, "message": self.message, "hint": self.hint}


class SpecError(ValueError):
    """Every problem found in one spec; raised once with all of them, never one at a time."""

    def __init__(
        self,
        issues: Iterable[SpecIssue],
        source: str = "<string>",
        behind: "ServiceSpec | None" = None,
    ) -> None:
        self.issues: list[SpecIssue] = list(issues)
        self.source: str = source
        # The spec without the fields these issues refuse (None when nothing is left to
        # check): `validate` checks it further and shows its warnings, so one run names every
        # problem, not only those of the parse (corral.spec.behind).
        self.behind = behind
        super().__init__(str(self))

    def __str__(self) -> str:
        if not self.issues:
            return SpecIssue("", "invalid service spec").format(self.source)
        return "\n".join(issue.format(self.source) for issue in self.issues)

    def __reduce__(self) -> tuple[type["SpecError"], tuple[list[SpecIssue], str]]:
        # Exceptions pickle through their args; ours are built from (issues, source), so say so
        # or the error breaks when it crosses a process boundary.
        return (type(self), (self.issues, self.source))
