"""The container's HEALTHCHECK: exit 0 when the server in this container answers GET /ready with 200.

Plain standard library, because the image has no curl. It reads the same NANOSERVE_* variables as
the server, so a changed port or host needs no change here. /ready is never behind the API key.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

# A server bound to every address is reached on loopback.
_ANY = {"", "0.0.0.0", "::", "[::]"}


def ready_url() -> str:
    host = os.environ.get("NANOSERVE_HOST", "0.0.0.0").strip()
    port = os.environ.get("NANOSERVE_PORT", "8000").strip()
    if host in _ANY:
        host = "127.0.0.1"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"  # a bare IPv6 address needs brackets in a URL
    return f"http://{host}:{port}/ready"


def main() -> int:
    url = ready_url()
    try:
        with urllib.request.urlopen(url, timeout=4) as response:
            status = response.status
    except urllib.error.HTTPError as error:  # 503 while loading, warming up or draining
        status = error.code
    except OSError as error:
        print(f"{url}: {error}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"{url}: HTTP {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
