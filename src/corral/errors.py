"""Why a service operation (create, update, rollback, down, ...) refuses a request.

Why named by meaning and not by HTTP status: the operations live below the API and must not know
HTTP; the API (corral.api_errors) turns each kind into its status in one table, so a new caller
(the dashboard, a test, a future CLI path without a daemon) reads what went wrong from the type.
Nothing here imports anything of corral's: every layer may import it.
"""

from __future__ import annotations

from typing import Any


class Refused(Exception):
    """An operation did nothing because of the request or the service's state; ``message``
    is for the user as is, ``details`` is structured data a client may show (spec issues)."""

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details


class InvalidRequest(Refused):
    """An argument the operation cannot take (a bad name, mode, combination of fields)."""


class BadSpec(InvalidRequest):
    """The service spec is invalid; ``details`` carries its issues and the located text."""


class Unrunnable(InvalidRequest):
    """A valid spec this daemon cannot run: no such backend, a port or size this machine
    does not have, a workdir that cannot be copied."""


class NotFound(Refused):
    """What the request names does not exist."""


class NoSuchService(NotFound):
    pass


class NoSuchVersion(NotFound):
    pass


class NoSuchReplica(NotFound):
    pass


class Conflict(Refused):
    """The request is well formed but the service's state does not allow it now."""


class ServiceExists(Conflict):
    pass


class ServiceShuttingDown(Conflict):
    pass


class ReplicaBusy(Conflict):
    """The replica is already going away."""


class ReplicaGoing(ReplicaBusy):
    """The replica is shutting down already, as asked: ``shutting_down`` in the answer tells a
    client that sent its request again (its first one cut by the daemon's crash) that the first
    one was done, where another refusal of the same status means it was not."""

    def __init__(self, message: str) -> None:
        super().__init__(message, shutting_down=True)


class NoRoom(Conflict):
    """An update could never finish on this machine: a blue-green one never switch, a rolling
    one never place its new replicas (docs/gpus.md)."""


class VersionFilesGone(Conflict):
    """A rollback to a version whose files were pruned past the rollback window."""


class HomeUnwritable(Refused):
    """The home's disk is full or read-only: the daemon's trouble, not the request's; nothing
    was changed and the same request may succeed later."""


def in_words(exc: BaseException | None) -> str:
    """An exception for a user's eyes (a replica's failure in ``status``). A backend says what
    went wrong in a RuntimeError's message, which ``repr`` wrapped in ``RuntimeError('...')``;
    any other type is kept, as the clue to an error nobody meant to raise."""
    if type(exc) is RuntimeError and str(exc):
        return str(exc)
    return repr(exc)
