"""Nothing that reads the network unpickles, unmarshals or evaluates anything.

Two proofs:

* statically, every module on a network path (``meshkit.wire``,
  ``meshkit.transport``, ``meshkit.node``, ``meshkit.pipeline``, ``meshkit.train``, the
  ``meshkit_tcp`` plugin and
  every meshkit or plugin module they import) is scanned for ``pickle``,
  ``marshal``, ``shelve`` and friends, for ``eval``/``exec``/``compile`` and
  for ``allow_pickle``;
* at run time, in a fresh interpreter, every unpickling and unmarshalling
  entry point is replaced by a tripwire and an audit hook watches for
  ``pickle.find_class``, ``marshal.load(s)``, ``exec`` and ``compile`` while
  real frames of every kind cross a real socket.

numpy itself imports :mod:`pickle` (for ``ndarray.dumps``), so "imports
pickle" is judged on meshkit's own code, and "uses pickle" at run time.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Everything that reads what arrives from the network (frames, jobs, trainer requests).
NETWORK_MODULES = ["meshkit.wire", "meshkit.transport", "meshkit.node", "meshkit.pipeline",
                   "meshkit.train", "meshkit_tcp"]
FORBIDDEN_MODULES = {"pickle", "_pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle",
                     "joblib", "copyreg"}
FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}


def _network_path_files() -> list[Path]:
    """Files of meshkit/plugin modules loaded by importing the network modules."""
    script = textwrap.dedent(f"""
        import importlib, pkgutil, sys
        for name in {NETWORK_MODULES!r}:
            module = importlib.import_module(name)
            for info in pkgutil.walk_packages(getattr(module, "__path__", []), name + "."):
                importlib.import_module(info.name)
        for module in list(sys.modules.values()):
            path = getattr(module, "__file__", None)
            if path:
                print(path)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    files = []
    for line in out.stdout.splitlines():
        path = Path(line).resolve()
        if path.suffix == ".py" and (ROOT / "meshkit" in path.parents
                                     or ROOT / "plugins" in path.parents):
            files.append(path)
    return sorted(set(files))


def _offences(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        shown = path.relative_to(ROOT) if ROOT in path.parents else path
        where = f"{shown}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in FORBIDDEN_MODULES:
                    found.append(f"{where} imports {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
                found.append(f"{where} imports from {node.module}")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else (
                func.attr if isinstance(func, ast.Attribute) else None)
            if isinstance(func, ast.Name) and name in FORBIDDEN_CALLS:
                found.append(f"{where} calls {name}()")
            # numpy's load refuses pickles only when told allow_pickle=False,
            # literally: that is the one form accepted (local checkpoints).
            refuses = any(k.arg == "allow_pickle" and isinstance(k.value, ast.Constant)
                          and k.value.value is False for k in node.keywords)
            if name in ("load", "loads") and isinstance(func, ast.Attribute) and isinstance(
                    func.value, ast.Name) and func.value.id in FORBIDDEN_MODULES | {"np", "numpy"}:
                if func.value.id in ("np", "numpy"):
                    if not refuses:
                        found.append(f"{where} calls {func.value.id}.{name}() (may unpickle)")
                else:
                    found.append(f"{where} calls {func.value.id}.{name}()")
            for keyword in node.keywords:
                if keyword.arg == "allow_pickle" and not refuses:
                    found.append(f"{where} passes allow_pickle")
        elif isinstance(node, ast.Attribute) and node.attr in ("__reduce__", "__reduce_ex__"):
            found.append(f"{where} touches {node.attr}")
    return found


def test_network_modules_never_reference_pickle_marshal_or_eval():
    files = _network_path_files()
    assert any(p.parent.name == "wire" for p in files), files
    offences = [o for path in files for o in _offences(path)]
    assert offences == [], "network code must not deserialise with pickle/marshal/eval:\n" + \
        "\n".join(offences)


def test_the_scanner_catches_what_it_is_meant_to(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import pickle\nfrom marshal import loads\nx = eval('1')\n"
                   "import numpy as np\nnp.load('f', allow_pickle=True)\n")
    found = _offences(bad)
    assert len(found) == 5, found
    good = tmp_path / "good.py"
    good.write_text("import numpy as np\nnp.load('f', allow_pickle=False)\n")
    assert _offences(good) == []
    bare = tmp_path / "bare.py"
    bare.write_text("import numpy as np\nnp.load('f')\nnp.load('f', allow_pickle=flag)\n")
    assert len(_offences(bare)) == 3, _offences(bare)


RUNTIME_PROBE = textwrap.dedent("""
    import importlib, pickle, _pickle, marshal, socket, sys, threading
    import numpy as np, ml_dtypes

    for name in NETWORK_MODULES:
        importlib.import_module(name)
    from meshkit import wire

    def exchange():
        a, b = socket.socketpair()
        box = {}
        t = threading.Thread(target=lambda: box.setdefault(
            "b", wire.handshake(b, b"s3cret-0123456789", rank=1, world=2, timeout=10)))
        t.start()
        ca = wire.handshake(a, b"s3cret-0123456789", rank=0, world=2, timeout=10)
        t.join()
        cb = box["b"]
        state = {"f": np.arange(6, dtype=np.float32).reshape(2, 3),
                 "h": np.ones(2, ml_dtypes.bfloat16), "b": np.array([True]),
                 "u": np.arange(3, dtype=np.uint64), "j": {"k": [1, "x", None, 2.5]},
                 "big": np.zeros(1 << 19, np.float32)}
        def in_background(fn):
            t = threading.Thread(target=fn)
            t.start()
            return t
        for bf16 in (False, True):
            t = in_background(lambda: ca.send(1, 2, state, bf16=bf16))
            frame = cb.recv()
            t.join()
            t = in_background(lambda: cb.forward(frame))
            ca.recv()
            t.join()
        wire.open_datagram(b"s3cret-0123456789", wire.seal_datagram(b"s3cret-0123456789", b"hello"))
        ca.close(); cb.close()

    exchange()  # warm up: every lazy import happens here, before the tripwires

    seen = []
    def tripwire(name):
        def refuse(*args, **kwargs):
            # Recorded as well as raised: a background thread's exception
            # could otherwise go unseen.
            seen.append(name)
            raise RuntimeError(f"TRIPWIRE: {name} was called on a network path")
        return refuse

    for module in (pickle, _pickle):
        for attr in ("load", "loads", "Unpickler"):
            if hasattr(module, attr):
                setattr(module, attr, tripwire(f"{module.__name__}.{attr}"))
    for attr in ("load", "loads"):
        setattr(marshal, attr, tripwire(f"marshal.{attr}"))

    armed = True
    def audit(event, args):
        if armed and event in ("pickle.find_class", "marshal.loads", "marshal.load",
                               "exec", "compile"):
            seen.append(event)
    sys.addaudithook(audit)
    exchange()
    if SELF_CHECK:
        threading.Thread(target=lambda: pickle.loads(b"")).start()
        eval("1")
    armed = False
    if seen:
        raise SystemExit(f"TRIPWIRE: {sorted(set(seen))} on a network path")
    print("CLEAN")
""")


def _probe(self_check: bool) -> subprocess.CompletedProcess:
    script = f"NETWORK_MODULES = {NETWORK_MODULES!r}\nSELF_CHECK = {self_check}\n" + RUNTIME_PROBE
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


def test_a_real_exchange_never_unpickles_unmarshals_or_evaluates():
    out = _probe(self_check=False)
    assert out.returncode == 0 and "CLEAN" in out.stdout, out.stdout + out.stderr


def test_the_runtime_tripwires_fire_when_pickle_or_eval_is_used():
    out = _probe(self_check=True)
    assert out.returncode != 0
    assert "pickle.loads" in out.stderr and "compile" in out.stderr, out.stderr


@pytest.mark.parametrize("value", [object(), {1, 2}, b"bytes"])
def test_values_pickle_would_carry_are_refused_by_the_encoder(value):
    from meshkit import wire
    from meshkit.errors import WireError

    with pytest.raises(WireError, match="neither a numpy array nor a JSON value"):
        wire.encode_state({"x": value})
