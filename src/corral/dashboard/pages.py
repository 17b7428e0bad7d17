"""The two documents the daemon writes itself: the login page and the app's shell.

The login page is made here (not a static file) because it says why the last attempt failed;
every value in it is escaped. The shell is static: the app draws every page in the browser from
the state stream.
"""

from __future__ import annotations

import html
from importlib import resources
from typing import Final

STATIC_TYPES: Final = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".html": "text/html; charset=utf-8",
    ".svg": "image/svg+xml",
}


def load_static() -> dict[str, tuple[bytes, str]]:
    """Every file of ``static/`` in memory (a few dozen KiB): name -> (bytes, content type).

    Read through importlib.resources, so it works from a wheel, an editable install or a zip.
    """
    out: dict[str, tuple[bytes, str]] = {}
    for entry in (resources.files("corral.dashboard") / "static").iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1] if "." in entry.name else ""
        if entry.is_file() and suffix in STATIC_TYPES:
            out[entry.name] = (entry.read_bytes(), STATIC_TYPES[suffix])
    return out


def login_page(message: str | None = None) -> str:
    notice = (
        f'<p class="notice bad" role="alert" id="login-error">{html.escape(message)}</p>'
        if message
        else ""
    )
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>corral: sign in</title>
<link rel="icon" href="/ui/static/icon.svg">
<link rel="stylesheet" href="/ui/static/app.css">
</head>
<body class="login">
<main class="login-box">
<h1>corral</h1>
{notice}
<p>Open the link that <code>corral dashboard</code> prints, or paste the API token
(<code>$CORRAL_HOME/token</code>).</p>
<form method="post" action="/ui/login">
<label for="token">API token</label>
<input id="token" name="token" type="password" autocomplete="off" required autofocus>
<button type="submit">Sign in</button>
</form>
</main>
</body>
</html>
"""
