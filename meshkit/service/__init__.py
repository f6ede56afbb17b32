"""The service: one long-running coordinator that outlives its runs (``meshkit serve``).

Nodes join it once and serve run after run; runs are submitted, listed,
followed and stopped through an authenticated control API; everything it
must remember lives in SQLite under ``[serve] state_dir``. One idea per file:

* ``_config.py`` — the ``[serve]`` table (every error names file, table, key);
* ``_store.py`` — the SQLite database: schema, migrations, runs, events, nodes;
* ``_protocol.py`` — what a node and the service say (HELLO, ASSIGN, DONE, REFUSED);
* ``_member.py`` — a node's side: join, serve each assignment, rejoin;
* ``_links.py`` — the service's side of a node: listener, handshake, admission;
* ``_scheduler.py`` — which node serves which run (authorization and fairness);
* ``_runs.py`` — one run: its directory, the config the service runs, its thread;
* ``_service.py`` — start-up, recovery after a crash, submit and stop;
* ``_http.py`` — the control API and status page (Starlette; extra ``serve``),
  loaded only when used (``ControlServer``);
* ``_client.py`` — the CLI's side of the control API.

docs/serve.md is the user's guide.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshkit._lazy import on_first_use

if TYPE_CHECKING:
    from meshkit.service._client import ServiceClient, locate_service
    from meshkit.service._config import ServeConfig, load_serve_config, parse_serve_config
    from meshkit.service._member import serve_service
    from meshkit.service._protocol import Assign, Done
    from meshkit.service._service import Service
    from meshkit.service._store import SCHEMA_VERSION, Store

#: Where each public name lives, loaded on first use: a node joining a service
#: (``meshkit node --service``) needs ``_member`` and ``_protocol``, not the
#: service's own side (which reaches the whole coordinator), its store or the
#: HTTP client; and every ``meshkit node`` imports this package. The control
#: server needs Starlette and uvicorn (extra "serve"), which a node never does.
#: The imports above name the same things for the type checker
#: (tests/kernel/test_lazy_imports.py keeps the two in step).
_WHERE: dict[str, str] = {
    "ServiceClient": "meshkit.service._client",
    "locate_service": "meshkit.service._client",
    "ServeConfig": "meshkit.service._config",
    "load_serve_config": "meshkit.service._config",
    "parse_serve_config": "meshkit.service._config",
    "serve_service": "meshkit.service._member",
    "Assign": "meshkit.service._protocol",
    "Done": "meshkit.service._protocol",
    "Service": "meshkit.service._service",
    "SCHEMA_VERSION": "meshkit.service._store",
    "Store": "meshkit.service._store",
    "ControlServer": "meshkit.service._http",
}

__all__ = ["ServeConfig", "load_serve_config", "parse_serve_config", "Service", "Store",
           "SCHEMA_VERSION", "serve_service", "Assign", "Done", "ServiceClient",
           "locate_service", "ControlServer"]


__getattr__, __dir__ = on_first_use(__name__, _WHERE, globals())
