"""``python -m inferbus_common.probe URL``: the containers' healthcheck.

Exits 0 when `URL` answers with a 2xx status within the timeout, 1 otherwise
(with the reason on stderr). Every argument is one word on purpose: Podman's
Docker-compatible API (4.x) splits a healthcheck's exec form at spaces, which
breaks ``python -c "..."``; see docs/operations.md ("Compose with Podman").
"""

from __future__ import annotations

import argparse
import ssl
import sys
import urllib.error
import urllib.request


def check(url: str, *, timeout_s: float = 2.0, insecure: bool = False) -> str:
    """Empty when `url` answers 2xx, else why not.

    Args:
        url: ``http://`` or ``https://`` URL.
        timeout_s: connect and read timeout.
        insecure: do not verify an HTTPS server's certificate (a local probe of
            a server whose certificate names its public host).
    """
    context = ssl._create_unverified_context() if insecure else None
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=context) as resp:
            status = resp.status
    except urllib.error.HTTPError as exc:
        return f"{url}: HTTP {exc.code}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return f"{url}: {exc}"
    return "" if 200 <= status < 300 else f"{url}: HTTP {status}"


def main(argv: list[str] | None = None) -> int:
    """Probe the URL given on the command line; 0 when it answers 2xx."""
    parser = argparse.ArgumentParser(prog="python -m inferbus_common.probe")
    parser.add_argument("url")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds (default 2)")
    parser.add_argument("--insecure", action="store_true", help="skip HTTPS certificate checks")
    args = parser.parse_args(argv)
    problem = check(args.url, timeout_s=args.timeout, insecure=args.insecure)
    if problem:
        print(problem, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
