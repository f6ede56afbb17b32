"""The control API is not a hole: no token, a wrong token or a cookie on a write is refused."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from meshkit.errors import AuthenticationError, ConfigError
from meshkit.service import ServeConfig, Service, locate_service
from tests.support.service import run_toml

# The control server is the extra "serve" (Starlette, uvicorn).
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
from meshkit.service import ControlServer  # noqa: E402


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    svc = Service(ServeConfig(state_dir=str(tmp_path / "state")))
    svc.start()
    assert svc.control_socket is not None
    control = ControlServer(svc, svc.control_socket)
    control.start()
    try:
        yield svc
    finally:
        control.close()
        svc.close()


def _status(url: str, *, method: str = "GET", headers: dict | None = None) -> int:
    request = urllib.request.Request(url, method=method, headers=headers or {},
                                     data=b"{}" if method == "POST" else None)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_every_route_wants_the_token(service: Service) -> None:
    base = service.control_address
    token = service.token.decode()
    assert _status(f"{base}/api/runs") == 401
    assert _status(f"{base}/api/runs", headers={"Authorization": "Bearer wrong"}) == 401
    assert _status(f"{base}/api/nodes", headers={"Authorization": f"Bearer {token}"}) == 200
    assert _status(f"{base}/static/app.js") == 404  # not even the page's script
    assert _status(f"{base}/") == 401  # the sign-in form, not the page
    # A browser's cookie reads; it never writes (no cross-site submit or stop).
    cookie = {"Cookie": f"meshkit_token={token}"}
    assert _status(f"{base}/api/runs", headers=cookie) == 200
    assert _status(f"{base}/api/runs/r1/stop", method="POST", headers=cookie) == 401


def test_the_cli_with_a_wrong_token_is_told_so(service: Service, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong.token"
    wrong.write_text("x" * 64)
    wrong.chmod(0o600)
    with pytest.raises(AuthenticationError, match="refused the token"):
        locate_service(service.control_address, str(wrong)).runs()


def test_a_bad_run_config_is_refused_at_submit_naming_its_file(service: Service,
                                                                 tmp_path: Path) -> None:
    client = locate_service(str(service.state))
    config = run_toml(tmp_path / "bad.toml", workers=1, rounds=2)
    text = config.read_text().replace('name = "fedavg"', 'name = "fedavgg"')
    with pytest.raises(ConfigError, match="fedavgg"):
        client.submit("bad.toml", text)
    with pytest.raises(ConfigError, match=r"bad.toml: \[mesh\] bind: the service decides it"):
        client.submit("bad.toml", text.replace("[mesh]\n", '[mesh]\nbind = "0.0.0.0:1"\n'))
    assert client.runs() == []
    good = client.submit("good.toml", config.read_text())
    assert (good["id"], good["state"]) == ("r1", "queued")  # no node yet: it waits
    assert client.stop("r1")["state"] == "stopped"
    assert json.loads((service.state / "service.json").read_text())["control"] == \
        service.control_address
