"""The status page in a real headless Chromium (driven over the DevTools protocol).

Chromium comes from the distribution's packages (`apt-get install chromium`,
done by .ci/run); without it the test is skipped, saying so.
"""

from __future__ import annotations

import itertools
import json
import queue
import shutil
import subprocess
import threading
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.support.service import Federation, run_toml

pytest.importorskip("starlette")  # the control server's extra, "serve"

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Page:
    """One Chromium tab, over its DevTools websocket."""

    def __init__(self, ws: Any) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        self._events: list[str] = []

    def call(self, method: str, timeout: float = 60, **params: Any) -> dict[str, Any]:
        ident = next(self._ids)
        self._ws.send(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            message = json.loads(self._ws.recv(timeout=timeout))
            if message.get("id") == ident:
                assert "error" not in message, message
                return dict(message["result"])
            if "method" in message:
                self._events.append(message["method"])

    def navigate(self, url: str = "", script: str = "", timeout: float = 60) -> None:
        """Load ``url`` (or run ``script``, which navigates) and return once the page loaded."""
        self._events.clear()
        if url:
            self.call("Page.navigate", url=url)
        else:
            self.call("Runtime.evaluate", expression=script)
        while "Page.loadEventFired" not in self._events:
            message = json.loads(self._ws.recv(timeout=timeout))
            if "method" in message:
                self._events.append(message["method"])

    def evaluate(self, expression: str, timeout: float = 60) -> Any:
        result = self.call("Runtime.evaluate", timeout=timeout, expression=expression,
                           awaitPromise=True, returnByValue=True)
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[str]:
    """A headless Chromium; yields its DevTools HTTP address."""
    if CHROMIUM is None:
        pytest.skip("no chromium on PATH (apt-get install chromium; .ci/run installs it)")
    proc = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                             "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1",
                             f"--user-data-dir={tmp_path / 'chromium'}", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    found: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "DevTools listening on ws://" in line:
                found.put(line.split("ws://", 1)[1].split("/", 1)[0])
        found.put("")

    threading.Thread(target=read, daemon=True).start()
    try:
        address = found.get(timeout=60)
        assert address, "chromium exited before listening"
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)


#: Resolves with the round the page shows for run r1 once it exceeds `after`.
_ROUND_ABOVE = """
new Promise((resolve, reject) => {
  const stop = Date.now() + 45000;
  (function look() {
    const cell = document.querySelector("#run-r1 td.round");
    const shown = cell ? Number(cell.dataset.round) : -1;
    if (shown > %d) return resolve(shown);
    if (Date.now() > stop) return reject(new Error("the page shows round " + shown + ": " + document.body.innerText.slice(0, 500)));
    setTimeout(look, 100);
  })();
})
"""


@pytest.mark.slow
def test_the_status_page_shows_a_live_runs_latest_round_and_keeps_updating(
        federation: Federation, browser: str) -> None:
    fed = federation
    info = fed.start_service()
    fed.start_node("n0")
    config = run_toml(fed.root / "live.toml", workers=1, rounds=100_000)
    client = fed.client()
    client.submit(config.name, config.read_text())
    fed.wait_round("r1", 1)

    with urllib.request.urlopen(f"http://{browser}/json/list", timeout=30) as response:
        target = next(t for t in json.loads(response.read()) if t["type"] == "page")
    from websockets.sync.client import connect

    with connect(target["webSocketDebuggerUrl"], max_size=None, open_timeout=30) as ws:
        page = Page(ws)
        page.call("Page.enable")
        page.navigate(info["control"] + "/")
        # Unauthenticated: the sign-in form, nothing about runs.
        assert page.evaluate("document.getElementById('login') !== null")
        assert page.evaluate("document.getElementById('runs') === null")
        token = (fed.state / "control.token").read_text().strip()
        page.evaluate(f"document.getElementById('token').value = {json.dumps(token)}; true")
        page.navigate(script="document.getElementById('login').submit()")
        first = page.evaluate(_ROUND_ABOVE % 0)
        # The page keeps up with the run: a later round than the one it showed...
        later = page.evaluate(_ROUND_ABOVE % first)
        assert later > first >= 1
        # ...the same round the service reports (or one it has since passed)...
        assert later <= client.status("r1")["run"]["rounds_completed"]
        # ...a plot of the run's metrics with a point per round seen, and the node.
        points = page.evaluate("Math.max(...[...document.querySelectorAll("
                               "'#run-r1 polyline')].map(p => Number(p.dataset.points)))")
        assert points >= 2
        assert page.evaluate("document.querySelector('#nodes tbody').innerText") \
            .count("yes") == 1
    client.stop("r1")
    assert fed.wait_run("r1")["state"] == "stopped"
