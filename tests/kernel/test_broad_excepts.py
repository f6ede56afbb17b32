"""Every broad ``except`` in meshkit/ and plugins/ re-raises, logs, or hands the exception on.

A broad handler (bare ``except:``, ``except Exception``, ``except BaseException``,
or a tuple naming one) catches bugs along with the failure it was written for.
It passes this rule when its body does one of:

- raises (``raise``, or ``pytest.fail`` / ``pytest.skip``, which raise);
- calls a logger (``log.warning(...)``, ``logging.debug(...)``, ...) *with the
  exception*: ``log.exception``, ``exc_info=``, or the bound name among the
  arguments, so what was swallowed is on record with its traceback or text;
- hands the exception object itself on, as is, to the code that raises or
  reports it (``outcome["error"] = exc``, ``queue.put((False, exc))``,
  ``failed.append(report(exc))``): a thread handing its failure to the one
  that joins it swallows nothing.

The rule walks the source's AST, so it holds for code added later too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BROAD = {"Exception", "BaseException"}
LEVELS = {"debug", "info", "warning", "error", "exception", "critical", "log"}
RAISING = {"fail", "skip", "xfail", "exit"}  # pytest.fail and friends raise
INSPECTING = {"type", "str", "repr", "format", "isinstance", "getattr", "hasattr", "id"}


def _is_broad(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(n, ast.Name) and n.id in BROAD for n in names)


def _mentions(node: ast.AST, name: str | None) -> bool:
    return name is not None and any(isinstance(n, ast.Name) and n.id == name
                                    for n in ast.walk(node))


def _is_logger_call(call: ast.Call, name: str | None) -> bool:
    func = call.func
    if not (isinstance(func, ast.Attribute) and func.attr in LEVELS
            and isinstance(func.value, ast.Name)
            and func.value.id.lower().endswith(("log", "logger", "logging"))):
        return False
    return (func.attr == "exception" or any(k.arg == "exc_info" for k in call.keywords)
            or any(_mentions(a, name) for a in call.args))


def _hands_on(node: ast.AST, name: str | None) -> bool:
    """The bound exception itself (not its text) is stored or passed on."""
    if name is None:
        return False

    def bare(value: ast.AST) -> bool:
        if isinstance(value, ast.Name):
            return value.id == name
        if isinstance(value, ast.Tuple):
            return any(bare(e) for e in value.elts)
        return False

    if isinstance(node, ast.Assign):
        return bare(node.value)
    if isinstance(node, ast.Call):
        if isinstance(node.func, ast.Name) and node.func.id in INSPECTING:
            return False  # type(exc), str(exc): reading it, not handing it on
        return any(bare(a) for a in node.args) or any(bare(k.value) for k in node.keywords)
    return False


def _accounts_for(handler: ast.ExceptHandler) -> bool:
    name = handler.name
    for node in ast.walk(ast.Module(body=handler.body, type_ignores=[])):
        if isinstance(node, ast.Raise):
            return True
        if isinstance(node, ast.Call):
            func = node.func
            if (isinstance(func, ast.Attribute) and func.attr in RAISING
                    and isinstance(func.value, ast.Name) and func.value.id == "pytest"):
                return True
            if _is_logger_call(node, name):
                return True
        if _hands_on(node, name):
            return True
    return False


def silent_broad_excepts(source: str, filename: str = "<source>") -> list[int]:
    """Line numbers of the broad handlers in ``source`` that break the rule."""
    tree = ast.parse(source, filename)
    return sorted(n.lineno for n in ast.walk(tree)
                  if isinstance(n, ast.ExceptHandler) and _is_broad(n) and not _accounts_for(n))


def test_no_broad_except_in_meshkit_or_plugins_swallows_silently():
    found = []
    for top in ("meshkit", "plugins"):
        for path in sorted((ROOT / top).rglob("*.py")):
            for line in silent_broad_excepts(path.read_text(), str(path)):
                found.append(f"{path.relative_to(ROOT)}:{line}")
    assert not found, ("broad excepts that neither raise, log the exception, nor hand it "
                       "on (see this test's docstring):\n  " + "\n  ".join(found))


def test_the_rule_flags_a_silent_handler_and_passes_the_accounted_ones():
    source = '''
try:
    f()
except Exception:
    pass
try:
    f()
except:
    x = 1
try:
    f()
except (ValueError, Exception) as exc:
    log.warning("f failed")          # logged, but without the exception
try:
    f()
except Exception as exc:
    note(f"{exc}")                   # only its text: the traceback is gone
try:
    f()
except Exception as exc:
    note(type(exc).__name__)         # likewise
try:
    f()
except ValueError:
    pass                             # narrow: not this rule's business
try:
    f()
except Exception:
    raise
try:
    f()
except Exception as exc:
    raise MeshError("f failed") from exc
try:
    f()
except Exception:
    log.debug("f failed", exc_info=True)
try:
    f()
except Exception as exc:
    logger.warning("f failed: %s", exc)
try:
    f()
except BaseException as exc:
    outcome["error"] = exc
try:
    f()
except BaseException as exc:
    results.put((False, exc))
try:
    f()
except Exception as exc:
    pytest.fail(f"f failed: {exc}")
'''
    assert silent_broad_excepts(source) == [4, 8, 12, 16, 20]
