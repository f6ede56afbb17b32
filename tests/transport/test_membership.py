"""Membership (meshkit/transport/_membership.py): its rules, and that it alone changes membership."""

from __future__ import annotations

import ast
import functools
import threading
from pathlib import Path

import pytest

from meshkit.transport import Membership

ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / "meshkit" / "transport" / "_membership.py"

#: The membership's own fields: nothing else reads or writes them.
PRIVATE = {"_dead", "_returning", "_left", "_joined"}
#: Names a dead ledger goes by outside: nothing else mutates one by these.
LEDGERS = {"dead", "returning", "left", "_dead", "_returning", "_left"}
MUTATORS = {"add", "pop", "popitem", "discard", "remove", "update", "clear", "setdefault",
            "difference_update", "intersection_update", "symmetric_difference_update"}
#: Where a rank is taken back: the membership, the group's and ledger's calls
#: through to it, the rounds' runner (between rounds), a host relay (at once).
TAKES_BACK = {"meshkit/transport/_membership.py", "meshkit/transport/_ledger.py",
              "meshkit/transport/_group.py", "meshkit/train/_coordinator/runner.py",
              "plugins/meshkit_tcp/relay.py"}


def test_a_dead_rank_that_joins_again_is_returning_and_dead_until_taken_back():
    members = Membership(0)
    assert members.join(1) is False and members.live([1]) == [1]
    assert members.declare_dead(1, "closed its connection")
    assert members.join(1) is True  # a restarted node
    assert members.returning() == [1] and members.live([1]) == [] and members.is_dead(1)
    assert members.take_back() == [1]
    assert members.dead() == {} and members.returning() == [] and members.live([1]) == [1]
    assert members.take_back() == []


def test_a_returning_rank_that_drops_again_stays_dead_with_the_new_reason():
    members = Membership(0)
    members.join(2)
    members.declare_dead(2, "stalled")
    members.join(2)
    assert members.declare_dead(2, "its new link failed")
    assert members.returning() == [] and members.reason(2) == "its new link failed"
    assert members.take_back() == []


def test_the_first_reason_stands_and_a_rank_is_never_dead_in_its_own_view():
    members = Membership(3)
    assert members.declare_dead(1, "first")
    assert not members.declare_dead(1, "second")
    assert members.reason(1) == "first"
    assert not members.declare_dead(3, "myself") and not members.is_dead(3)
    assert members.describe() == "rank 1: first"


def test_a_goodbye_is_told_apart_from_a_death_and_forgotten_when_taken_back():
    members = Membership(0)
    for rank in (1, 2):
        members.join(rank)
    members.declare_dead(1, "closed its connection (left the mesh)", left=True)
    members.declare_dead(2, "stalled")
    assert members.left() == [1] and sorted(members.dead()) == [1, 2]
    members.join(1)
    members.join(2)
    assert members.take_back([1]) == [1]  # only those asked for
    assert members.left() == [] and members.returning() == [2]


def test_every_change_wakes_a_waiter_on_a_shared_condition():
    cv = threading.Condition()
    members = Membership(0, cv=cv)
    members.join(1)
    woke = threading.Event()

    def wait() -> None:
        with cv:
            if cv.wait_for(lambda: members.is_dead(1), timeout=10):
                woke.set()

    waiter = threading.Thread(target=wait)
    waiter.start()
    members.declare_dead(1, "lost")
    waiter.join(10)
    assert woke.is_set()


@functools.cache
def _sources() -> list[tuple[str, ast.AST]]:
    """Every kernel and built-in plugin module but the membership's, parsed once."""
    files = sorted([*(ROOT / "meshkit").rglob("*.py"), *(ROOT / "plugins").rglob("*.py")])
    return [(p.relative_to(ROOT).as_posix(), ast.parse(p.read_text(), filename=str(p)))
            for p in files if p != HOME]


def _ledger_name(node: ast.AST) -> str | None:
    """The name of the ledger ``node`` stands for (``x.dead``, ``self._left``), or None."""
    if isinstance(node, ast.Attribute) and node.attr in LEDGERS:
        return node.attr
    return None


def _breaches(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in PRIVATE:
            found.append((node.lineno, f"touches the membership's own field {node.attr}"))
        targets: list[ast.AST] = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = (node.targets if isinstance(node, (ast.Assign, ast.Delete))
                       else [node.target])
        for target in targets:
            inner = target.value if isinstance(target, ast.Subscript) else target
            name = _ledger_name(inner)
            if name is not None:
                found.append((node.lineno, f"writes a dead ledger ({name})"))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in MUTATORS and _ledger_name(node.func.value)):
            found.append((node.lineno, f"mutates a dead ledger (.{node.func.attr})"))
    return found


def test_no_module_but_the_membership_keeps_or_changes_a_dead_ledger():
    breaches = [f"{path}:{line}: {what}" for path, tree in _sources()
                for line, what in _breaches(tree)]
    assert breaches == [], ("membership changes only in meshkit/transport/_membership.py; "
                            "declare through group.declare_dead / Membership instead:\n"
                            + "\n".join(breaches))


def test_ranks_are_taken_back_only_where_the_membership_module_says():
    callers = {path for path, tree in _sources() for node in ast.walk(tree)
               if isinstance(node, ast.Attribute) and node.attr == "take_back"}
    assert callers <= TAKES_BACK - {"meshkit/transport/_membership.py"}, sorted(callers)


@pytest.mark.parametrize("source, expected", [
    ("self._dead[rank] = why", 2),          # the private field, written
    ("pool.dead.pop(rank)", 1),             # a ledger mutated by name
    ("x.left.add(3)", 1),
    ("del relay._returning", 2),
    ("print(group.dead[1])", 0),            # reading is fine
    ("dead = dict(group.dead); dead[1] = 'x'", 0),  # a local copy is not the ledger
])
def test_the_rule_catches_writes_and_lets_reads_through(source, expected):
    assert len(_breaches(ast.parse(source))) == expected


def test_the_generation_moves_with_every_change_and_only_then():
    members = Membership(0)
    seen = [members.generation]

    def step(changed: bool) -> None:
        seen.append(members.generation)
        assert (seen[-1] != seen[-2]) is changed, seen

    members.join(1)
    step(True)
    members.live([1]), members.dead(), members.joined()
    step(False)
    members.declare_dead(1, "closed its connection")
    step(True)
    members.declare_dead(1, "again")  # already dead: nothing changes
    step(False)
    members.join(1)  # returning
    step(True)
    assert members.take_back() == [1]
    step(True)
    assert members.take_back() == []
    step(False)
