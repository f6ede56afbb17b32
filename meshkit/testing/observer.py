"""The observer contract suite: an observer heard through a real two-round run.

Subclass :class:`ObserverContract` and point it at your observer; override
:meth:`ObserverContract.check_recorded` to say what a run should leave
behind (the suite cannot know your tracker's output)::

    class TestMyTracker(ObserverContract):
        component = "my-tracker"
        options = {"project": "demo"}

        def check_recorded(self, out, tmp_path):
            assert len(read_my_log(out / "tracker.log")) == 2   # one line per round

What it checks:

* building the observer (its factory) does no I/O: no file opened or
  created, no directory made, no socket connected or bound, no process
  started (seen through Python's audit hooks). The factory runs when a
  config is checked; files and connections belong in ``meshkit_run_started``;
* every ``meshkit_*`` method carries ``@meshkit.hookimpl`` (pluggy skips an
  unmarked one silently: an observer deaf to its rounds), and it implements
  every event of :attr:`ObserverContract.hears`;
* a real run (``meshkit.run``: task ``digits``, strategy ``local``, two
  rounds) with the observer in ``[[observers]]`` calls it the way every run
  does: ``meshkit_run_started`` once, ``meshkit_round_completed`` once per
  round, ``meshkit_run_finished`` once, and none of them raises (a raising
  observer is only logged by a run, so the suite catches what a run hides).
"""

from __future__ import annotations

import inspect
import sys
import threading
from pathlib import Path
from typing import Any, ClassVar, Mapping

import pytest

import meshkit
from meshkit import plugins
from meshkit.testing import make_plugin_set, use_plugins
from meshkit.testing.support import ContractBase

__all__ = ["ObserverContract", "RUN_EVENTS"]

#: The events a run's ``[[observers]]`` hear, in the order a run sends them.
RUN_EVENTS = ("meshkit_run_started", "meshkit_round_completed", "meshkit_run_finished")

#: Audit events that are I/O a factory must not do.
_IO_EVENTS = frozenset({"open", "os.mkdir", "os.remove", "os.rename", "os.rmdir",
                        "socket.connect", "socket.bind", "subprocess.Popen",
                        "urllib.Request", "sqlite3.connect"})
#: Files the import machinery opens (a factory may import its module lazily).
_IMPORT_FILES = (".py", ".pyc", ".so", ".pyd", ".pth", ".typed")

_watch = threading.local()
_installed = False
_install_lock = threading.Lock()


def _importing() -> bool:
    """Whether the I/O comes from the import system (a lazy import is not the factory's I/O)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(("<frozen importlib", "<frozen zipimport")):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _audit(event: str, args: tuple[Any, ...]) -> None:
    seen = getattr(_watch, "seen", None)
    if seen is None or event not in _IO_EVENTS or _importing():
        return
    if event == "open":
        path = args[0]
        if isinstance(path, int):
            return  # an already-open descriptor
        text = path.decode(errors="replace") if isinstance(path, bytes) else str(path)
        if text.endswith(_IMPORT_FILES) or "__pycache__" in text or ".dist-info" in text \
                or ".egg-info" in text:
            return
        seen.append(f"open({text!r}, {args[1]!r})")
        return
    seen.append(f"{event}{tuple(str(a)[:80] for a in args)}")


def io_during(fn: Any) -> tuple[Any, list[str]]:
    """``fn()``'s result and the I/O it did on this thread (files, sockets, processes)."""
    global _installed
    with _install_lock:
        if not _installed:
            # An audit hook cannot be removed; it stays idle unless a thread watches.
            sys.addaudithook(_audit)
            _installed = True
    _watch.seen = []
    try:
        result = fn()
        return result, list(_watch.seen)
    finally:
        _watch.seen = None


class ObserverContract(ContractBase):
    """Conformance tests every meshkit observer must pass."""

    kind: ClassVar[str] = "observer"
    #: The run events the observer is meant to hear (each must be implemented and marked).
    hears: ClassVar[tuple[str, ...]] = RUN_EVENTS
    #: Rounds of the run the suite plays.
    rounds: ClassVar[int] = 2

    def observer_options(self, tmp_path: Path) -> Mapping[str, Any]:
        """The ``[[observers]]`` options for the run (override to put files under ``tmp_path``)."""
        return dict(self.options)

    def check_recorded(self, out: Path, tmp_path: Path) -> None:
        """What the observer should have recorded of the run in ``out`` (override)."""

    # -- construction ------------------------------------------------------

    def test_building_the_observer_does_no_io(self, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.chdir(tmp_path)
        pset = make_plugin_set(*self.plugins) if self.plugins is not None else plugins.default()
        name = str(self.component)
        # Plugins found and options checked first: only the factory is watched.
        component = pset.registry.get(self.kind, name)
        options = pset.registry.options(self.kind, name, {**self.observer_options(tmp_path)})
        _, io = io_during(lambda: component.build(options))
        assert io == [], (
            f"building the observer did I/O: {'; '.join(io[:5])}. The factory runs whenever "
            f"a config is checked; open files and connections in meshkit_run_started")
        assert list(tmp_path.iterdir()) == [], "building the observer created files"

    def test_every_hook_method_is_marked(self, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.chdir(tmp_path)  # whatever a faulty factory writes lands here
        observer = self.make(**self.observer_options(tmp_path))
        pset = plugins.build_manager({"observer": observer}, entry_points=False)
        marked = set(pset.hooks_of("observer"))
        unmarked = sorted(name for name, value in inspect.getmembers(type(observer))
                          if name.startswith("meshkit_") and callable(value)
                          and name not in marked)
        assert unmarked == [], (
            f"{', '.join(unmarked)} lack @meshkit.hookimpl: pluggy ignores an unmarked method, "
            f"so the observer never hears those events")
        missing = [event for event in self.hears if event not in marked]
        assert missing == [], (
            f"the observer does not implement {', '.join(missing)} (declared in `hears`)")

    # -- a real run ----------------------------------------------------------

    def test_a_two_round_run_calls_every_hook_as_a_run_does(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.chdir(tmp_path)  # a tracker's relative defaults (./mlruns) land here
        kind = type(self.make(**self.observer_options(tmp_path)))
        heard: list[str] = []
        raised: list[str] = []
        notify = plugins.notify

        def spy(pset: Any, hook_name: str, /, **kwargs: Any) -> list[Any]:
            impls = getattr(pset.hook, hook_name).get_hookimpls()
            ours = [i for i in impls if isinstance(i.plugin, kind)]
            failures = notify(pset, hook_name, **kwargs)
            if ours:
                heard.append(hook_name)
                raised.extend(f.describe() for f in failures
                              if any(f.plugin == i.plugin_name for i in ours))
            return failures

        monkeypatch.setattr(plugins, "notify", spy)
        out = tmp_path / "run"
        config = {
            "run": {"task": "digits", "seed": 3, "out": str(out)},
            "strategy": {"name": "local", "rounds": self.rounds},
            "observers": [{"name": self.component, **self.observer_options(tmp_path)}],
        }
        with use_plugins(*(self.plugins or ())):
            report = meshkit.run(config)
        assert report.ok, f"the run failed: {report.error}"
        assert raised == [], "the observer raised during the run:\n" + "\n".join(raised)
        expected = {"meshkit_run_started": 1, "meshkit_round_completed": self.rounds,
                    "meshkit_run_finished": 1}
        for event in self.hears:
            assert heard.count(event) == expected[event], (
                f"{event}: heard {heard.count(event)} times in a {self.rounds}-round run, "
                f"expected {expected[event]} (heard: {heard})")
        self.check_recorded(out, tmp_path)
