"""The chat playground: one self-contained HTML page (playground.html, shipped as package data), served at
`GET /playground` without the API key (the key is typed into the page, which sends it with each request).

Its Content-Security-Policy lets the page run only its own inline script and style (by their SHA-256) and talk only
to the server that sent it: no other origin is reached, and text that found its way into the DOM could run nothing.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re
from importlib import resources

PAGE_FILE = "playground.html"


def _hashes(html: str, tag: str) -> str:
    """CSP sources for each inline <tag> element of `html`: the SHA-256 of its exact text, as browsers hash it."""
    bodies = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.DOTALL)
    return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in bodies)


@functools.cache
def page() -> tuple[bytes, dict[str, str]]:
    """The page's bytes and its response headers, read once."""
    html = (resources.files("gpt2x") / "serve" / "openai" / PAGE_FILE).read_text(encoding="utf-8")
    policy = ("default-src 'none'; "
              f"script-src {_hashes(html, 'script')}; style-src {_hashes(html, 'style')}; "
              "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    headers = {"Content-Security-Policy": policy, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
               "Cache-Control": "no-cache"}  # revalidated: a server upgraded serves its own page at once
    return html.encode("utf-8"), headers
