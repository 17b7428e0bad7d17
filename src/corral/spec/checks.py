"""Checks of a parsed spec against the world outside its text: the workdir on this machine,
values given at launch, a name from the command line; and the spec as stored (secrets redacted).

They are apart from the models because they need more than the text (a directory, the
``--env`` names given) and run where that is known: the CLI, and the daemon at create/update.
"""

import os
import secrets
from collections.abc import Iterable
from pathlib import Path

import yaml
from yaml.nodes import MappingNode, ScalarNode

from corral.spec.errors import SpecError, SpecIssue
from corral.spec.locate import child_node
from corral.spec.model import ServiceSpec, value_flag
from corral.spec.values import name_problem


def generated_name() -> str:
    """A name for a service started without one, shaped as SkyServe makes them
    (``sky-service-`` and 4 hex digits there): ``corral-service-`` and 4 random hex digits."""
    return f"corral-service-{secrets.token_hex(2)}"


def missing_values(
    spec: ServiceSpec, envs: Iterable[str] = (), secrets: Iterable[str] = ()
) -> list[SpecIssue]:
    """Keys the spec leaves without a value that ``envs``/``secrets`` (the names given on the
    command line) do not give either: each is an error at up/update, naming the flag."""
    given = {f"envs.{k}" for k in envs} | {f"secrets.{k}" for k in secrets}
    issues = []
    for field, line in spec.unset_values().items():
        if field in given:
            continue
        flag, key = value_flag(field), field.split(".", 1)[1]
        issues.append(
            SpecIssue(
                field,
                "has no value in the spec and none was given",
                line,
                f"pass {flag} {key}=VALUE (or {flag} {key} to take it from your environment)",
            )
        )
    return issues


def redact_secrets(text: str) -> str:
    """``text`` with the value of every ``secrets:`` key replaced: what is stored and shown of a
    spec. Only the value's characters change, so every line keeps its number."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return text
    section = child_node(root, "secrets")
    if not isinstance(section, MappingNode):
        return text
    spans = [
        (value.start_mark.index, value.end_mark.index)
        for _, value in section.value
        if not (isinstance(value, ScalarNode) and value.tag == "tag:yaml.org,2002:null")
    ]
    for start, end in sorted(spans, reverse=True):
        # A block scalar's span takes its lines (and the line break after it): keep as many
        # breaks, so the YAML stays valid and every later line keeps its number.
        text = text[:start] + REDACTED + "\n" * text.count("\n", start, end) + text[end:]
    return text


REDACTED = "'<redacted>'"


def path_issues(spec: ServiceSpec, base_dir: str | os.PathLike[str]) -> list[SpecIssue]:
    """The spec's ``workdir`` when it does not exist, and its ``service.tls`` files when they
    cannot be read, relative ones taken from ``base_dir`` (the directory corral was called
    from, as SkyPilot does). What a backend makes of ``file_mounts`` is its own rule (for
    local: :mod:`corral.infra.local_rules`)."""
    issues = tls_issues(spec, base_dir)
    if spec.workdir:
        where = Path(base_dir, Path(spec.workdir).expanduser())
        if not where.is_dir():
            what = "is not a directory" if where.exists() else "does not exist"
            hint = "run corral from the directory the path is relative to, or give an absolute path"
            if "$" in spec.workdir:  # an env with no value here: `up` fills it from --env
                hint = "give the variable it names a value in envs, or with --env at up/update"
            issues.append(
                SpecIssue(
                    "workdir",
                    f"{where} {what} (a relative workdir is taken from the directory corral "
                    f"is run in, {base_dir}, as in SkyPilot)",
                    spec.line_of("workdir"),
                    hint,
                )
            )
    return issues


def tls_paths(
    spec: ServiceSpec, base_dir: str | os.PathLike[str] | None
) -> tuple[Path, Path] | None:
    """The service's (certificate, key) files, or None without TLS: ``~`` expanded, a relative
    path taken from ``base_dir`` (the directory the CLI ran in, as ``workdir`` is: SkyPilot's
    rule; ``/`` when it is not known). The one rule for ``validate``, the version's copies and
    the balancer's route."""
    tls = spec.service.tls
    if tls is None:
        return None
    cert, key = (Path(base_dir or "/", Path(v).expanduser()) for v in (tls.certfile, tls.keyfile))
    return cert, key


def tls_issues(spec: ServiceSpec, base_dir: str | os.PathLike[str]) -> list[SpecIssue]:
    """``service.tls.keyfile``/``certfile`` that are not readable files. The balancer loads
    them only once the service exists, so a missing one would fail the whole service
    (CONTROLLER_FAILED, a bare FileNotFoundError) instead of being refused here."""
    files = tls_paths(spec, base_dir)
    if files is None:
        return []
    issues = []
    readable = []
    for field, where in (("keyfile", files[1]), ("certfile", files[0])):
        if where.is_file() and os.access(where, os.R_OK):
            readable.append(where)
            continue
        if where.is_file():
            what = "cannot be read"
        else:
            what = "is not a file" if where.exists() else "does not exist"
        issues.append(
            SpecIssue(
                f"service.tls.{field}",
                f"{where} {what} (a relative path is taken from the directory corral is run "
                f"in, {base_dir}, as in SkyPilot)",
                spec.line_of(f"service.tls.{field}"),
                "give the PEM file's path (absolute, or relative to where you run corral)",
            )
        )
    if len(readable) == 2:
        problem = tls_pair_problem(certfile=readable[1], keyfile=readable[0])
        if problem is not None:
            field, message, hint = problem
            line = spec.line_of(f"service.tls.{field}")
            issues.append(SpecIssue(f"service.tls.{field}", message, line, hint))
    return issues


class _Encrypted(Exception):
    """OpenSSL asked for the key's passphrase: refused instead of prompting on a terminal."""


def _no_passphrase() -> bytes:
    raise _Encrypted


def tls_pair_problem(certfile: Path, keyfile: Path) -> tuple[str, str, str] | None:
    """Why the balancer could not serve with this certificate and key, as (field, message,
    hint), or None: the workers load them only once the service exists, where a file that is
    not PEM, a key of another certificate or a key with a passphrase would fail the service
    (or, at an update, leave the old certificate in use until a restart fails it)."""
    import ssl  # only when a spec has TLS: the CLI's other commands do not pay for it

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=str(certfile))
    except (OSError, ssl.SSLError) as exc:
        return "certfile", f"{certfile} holds no PEM certificate ({exc})", _PEM_HINT
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # not the system's CAs: not needed
    try:
        context.load_cert_chain(str(certfile), str(keyfile), password=_no_passphrase)
    except _Encrypted:
        return (
            "keyfile",
            f"{keyfile} is encrypted (it needs a passphrase, which corral has no way to give)",
            "give the key without its passphrase (openssl pkey -in KEY -out PLAIN_KEY)",
        )
    except (OSError, ssl.SSLError) as exc:
        if "KEY_VALUES_MISMATCH" in str(exc):
            message = f"{keyfile} is not the private key of certfile {certfile}"
            return "keyfile", message, "give the key the certificate was made for"
        return "keyfile", f"{keyfile} holds no PEM private key ({exc})", _PEM_HINT
    return None


_PEM_HINT = "give PEM files: certfile the certificate (chain), keyfile its private key"


def validate_name(name: str) -> None:
    """Check a service name (from a spec or the command line) before it reaches paths or URLs."""
    problem = name_problem(name)
    if problem:
        raise SpecError([SpecIssue("name", problem, None)], source="")
