"""Container health check: is the Serve HTTP proxy on this node answering?

The images' HEALTHCHECK runs `python -m saguaro_dist.deploy.healthcheck` (exit 0 healthy, 1 not). On
Kubernetes the pod probes of the manifests apply instead; this is for plain `docker run`.
"""
from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8000/-/healthz"  # Ray Serve's proxy health route


def healthy(url: str, timeout_s: float = 3.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def main() -> int:
    return 0 if healthy(os.environ.get("SAGUARO_HEALTHCHECK_URL", DEFAULT_URL)) else 1


if __name__ == "__main__":
    sys.exit(main())
