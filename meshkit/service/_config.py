"""The ``[serve]`` table of ``meshkit serve CONFIG``: where the service listens and keeps state.

Every mistake is a :class:`~meshkit.errors.ConfigError` naming the file, the
table and the key (``structure_strict`` does the naming), so the CLI exits 2
with one paragraph. Addresses are checked when the file loads; whether the
control address may leave loopback (only with TLS) is decided here too, so a
service never starts listening for commands unauthenticated beyond this host.
"""

from __future__ import annotations

import ipaddress
import os
import tomllib
from pathlib import Path
from typing import Any

import attrs

from meshkit.errors import ConfigError
from meshkit.options import structure_strict

__all__ = ["ServeConfig", "load_serve_config", "parse_serve_config", "is_loopback"]


def _address(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    host, sep, port = str(value).strip().rpartition(":")
    if not sep or not host.strip("[]"):
        raise ValueError(f"{attribute.name} must be host:port (e.g. 127.0.0.1:0), got {value!r}")
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"{attribute.name} must have a numeric port, got {value!r}") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"{attribute.name} must have a port in 0..65535 (0 picks a free one, "
                         f"kept across restarts), got {value!r}")


def _non_empty(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    if not str(value).strip():
        raise ValueError(f"{attribute.name} must name a directory (the service's database, "
                         f"run directories and secrets live there)")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine's loopback."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@attrs.frozen
class ServeConfig:
    """``[serve]``: one long-running coordinator service (docs/serve.md)."""

    #: Where the service keeps ``service.db`` (SQLite), each run's directory
    #: (config, checkpoints, metrics) and the secrets it generates.
    state_dir: str = attrs.field(validator=_non_empty)
    #: Where nodes join (``meshkit node --service HOST:PORT``); port 0 picks a
    #: free one on the first start and the service keeps it across restarts,
    #: so nodes rejoin the address they know.
    bind: str = attrs.field(default="127.0.0.1:0", validator=_address)
    #: The control API and status page (``meshkit submit/ls/status/logs/stop
    #: --service``); beyond loopback only with ``tls_cert`` and ``tls_key``.
    control: str = attrs.field(default="127.0.0.1:0", validator=_address)
    #: The nodes' shared secret (mode 0600); "" generates STATE_DIR/nodes.secret once.
    secret_file: str = ""
    #: Node keys admitted to the service at all ("" : any node holding the
    #: secret). Each run's ``[mesh] authorized_nodes`` narrows it further.
    authorized_nodes: str = ""
    #: Who may submit, stop and read: whoever holds this token (a file of
    #: mode 0600); "" generates STATE_DIR/control.token once.
    token_file: str = ""
    #: TLS for the control address (both or neither); needed beyond loopback.
    tls_cert: str = ""
    tls_key: str = ""
    #: Host each run's coordinator binds (port 0 each); "" : ``bind``'s host.
    run_host: str = ""
    #: Seconds a node waits for its run's coordinator, and the run for its nodes.
    join_timeout: float = attrs.field(default=60.0, validator=attrs.validators.gt(0))
    #: Where this table was read from (error messages).
    path: str = attrs.field(default="<serve>", eq=False)

    @property
    def state(self) -> Path:
        return Path(self.state_dir)

    def host_port(self, key: str) -> tuple[str, int]:
        host, _, port = str(getattr(self, key)).strip().rpartition(":")
        return host.strip("[]"), int(port)


def parse_serve_config(data: Any, *, path: str = "<serve>") -> ServeConfig:
    """The ``[serve]`` table of a parsed TOML document; a ConfigError naming file, table, key."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected TOML tables, got {type(data).__name__}")
    extra = sorted(set(data) - {"serve"})
    if extra:
        raise ConfigError(f"{path}: [{extra[0]}]: unknown table; a service's config holds only "
                          f"[serve] (runs bring their own config with `meshkit submit`)")
    if "serve" not in data:
        raise ConfigError(f"{path}: no [serve] table; it needs at least state_dir = \"DIR\"")
    table = data["serve"]
    where = f"{path}: [serve]"
    if isinstance(table, dict) and "path" in table:
        raise ConfigError(f"{where} path: unknown key")
    config: ServeConfig = structure_strict(table, ServeConfig, where=where)
    config = attrs.evolve(config, path=path)
    if bool(config.tls_cert) != bool(config.tls_key):
        key = "tls_key" if config.tls_cert else "tls_cert"
        raise ConfigError(f"{where} {key}: tls_cert and tls_key go together; set both or neither")
    host, _ = config.host_port("control")
    if not is_loopback(host) and not config.tls_cert:
        raise ConfigError(
            f"{where} control: {config.control!r} is not loopback, and the control channel "
            f"carries the submit token: set tls_cert and tls_key to serve it over TLS, or "
            f"keep control on 127.0.0.1 (reach it over ssh -L)")
    base = Path(path).parent if path not in ("<serve>", "<mapping>") else Path.cwd()
    resolved: dict[str, Any] = {key: str(base / value) for key in ("state_dir", "secret_file", "authorized_nodes",
                                                     "token_file", "tls_cert", "tls_key")
                if (value := getattr(config, key)) and not os.path.isabs(value)}
    return attrs.evolve(config, **resolved)


def load_serve_config(path: str | os.PathLike[str]) -> ServeConfig:
    """Read ``meshkit serve CONFIG``'s file."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{name}: no such config file") from None
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read config file: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{name}: not valid TOML: {exc}") from None
    return parse_serve_config(data, path=name)
