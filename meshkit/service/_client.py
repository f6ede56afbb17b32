"""The CLI's side of the control API: find the service, send the token, read JSON.

``--service`` is either the service's control address (``HOST:PORT`` or a
URL; the token then comes from ``--token-file`` or
``MESHKIT_SERVICE_TOKEN_FILE``) or, on the service's own host, its state
directory, whose ``service.json`` says where it listens and which token
file it reads. The token file must be private (mode 0600), as every secret
meshkit reads.
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from meshkit import wire
from meshkit.errors import AuthenticationError, ConfigError, PeerLostError

__all__ = ["ServiceClient", "locate_service"]


class ServiceClient:
    """Calls the control API of a running ``meshkit serve``."""

    def __init__(self, url: str, token: bytes, *, cafile: str | None = None,
                 timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self._token = token.decode()
        self._timeout = timeout
        self._context = ssl.create_default_context(cafile=cafile) if url.startswith("https") \
            else None

    def _call(self, method: str, path: str, body: Any = None, *,
              timeout: float | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method=method,
            headers={"Authorization": f"Bearer {self._token}",
                     "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout or self._timeout,
                                        context=self._context) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read()).get("error", exc.reason)
            except (ValueError, AttributeError):
                message = exc.reason
            if exc.code == 401:
                raise AuthenticationError(f"the service at {self.url} refused the token: "
                                          f"{message}") from None
            raise ConfigError(str(message)) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise PeerLostError(f"no service answers at {self.url} ({reason}); is `meshkit "
                                f"serve` running there?") from None

    def runs(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/api/runs")["runs"])

    def submit(self, name: str, config: str, authorized: str | None = None) -> dict[str, Any]:
        return dict(self._call("POST", "/api/runs", {"name": name, "config": config,
                                                       "authorized": authorized})["run"])

    def status(self, run: str) -> dict[str, Any]:
        return dict(self._call("GET", f"/api/runs/{urllib.parse.quote(run)}"))

    def events(self, run: str, *, after: int = 0, wait: float = 0.0) -> dict[str, Any]:
        query = urllib.parse.urlencode({"after": after, "wait": wait})
        return dict(self._call("GET", f"/api/runs/{urllib.parse.quote(run)}/events?{query}",
                               timeout=self._timeout + wait))

    def stop(self, run: str) -> dict[str, Any]:
        return dict(self._call("POST", f"/api/runs/{urllib.parse.quote(run)}/stop", {})["run"])

    def nodes(self) -> dict[str, Any]:
        return dict(self._call("GET", "/api/nodes"))


def locate_service(service: str | None, token_file: str | None = None, *,
                   environ: Any = None) -> ServiceClient:
    """The client for ``--service`` / ``--token-file`` (module docstring)."""
    env = os.environ if environ is None else environ
    service = service or env.get("MESHKIT_SERVICE") or ""
    token_file = token_file or env.get("MESHKIT_SERVICE_TOKEN_FILE") or None
    if not service:
        raise ConfigError("no service: pass --service HOST:PORT (the control address `meshkit "
                          "serve` prints) or --service STATE_DIR (on the service's host), or "
                          "set MESHKIT_SERVICE")
    if Path(service).is_dir():
        info_file = Path(service) / "service.json"
        try:
            info = json.loads(info_file.read_text())
            url, kept = str(info["control"]), str(info["token_file"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"--service {service}: cannot read {info_file} ({exc}); has "
                              f"`meshkit serve` started with this state_dir?") from None
        token_file = token_file or kept
    else:
        url = service if "://" in service else f"http://{service}"
    if not token_file:
        raise ConfigError(f"--service {service}: no token: pass --token-file FILE (the "
                          f"service's control token) or set MESHKIT_SERVICE_TOKEN_FILE")
    token = wire.read_secret_file(Path(token_file), "--token-file")
    return ServiceClient(url, token, cafile=env.get("MESHKIT_SERVICE_CA") or None)
