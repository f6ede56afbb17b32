"""The SecAgg+ graph: k-regular, symmetric, drawn from the public seed alone."""

from __future__ import annotations

import pytest

from meshkit_secagg import neighbours


@pytest.mark.parametrize("n,k", [(10, 2), (30, 6), (101, 14), (64, 62)])
def test_the_graph_is_k_regular_and_symmetric(n: int, k: int) -> None:
    graph = neighbours(b"seed", list(range(100, 100 + n)), k)
    assert set(graph) == set(range(100, 100 + n))
    for member, near in graph.items():
        assert len(near) == k and member not in near and list(near) == sorted(near)
        assert all(member in graph[other] for other in near)


def test_the_graph_depends_on_the_seed_and_the_member_set_only() -> None:
    members = list(range(40))
    graph = neighbours(b"a", members, 6)
    assert graph == neighbours(b"a", list(reversed(members)), 6)
    assert graph != neighbours(b"b", members, 6)


def test_degree_zero_or_at_least_n_minus_one_is_the_complete_graph() -> None:
    for degree in (0, 9, 10, 50):
        graph = neighbours(b"s", range(10), degree)
        assert all(len(near) == 9 for near in graph.values())


def test_an_odd_degree_is_raised_by_one() -> None:
    graph = neighbours(b"s", range(20), 5)
    assert {len(near) for near in graph.values()} == {6}


def test_repeated_members_are_refused() -> None:
    with pytest.raises(ValueError, match="distinct"):
        neighbours(b"s", [1, 2, 2], 2)


def test_the_graph_is_drawn_once_a_round_and_each_caller_gets_its_own_copy() -> None:
    graph = neighbours(b"s", range(30), 6)
    graph[0] = ()
    assert neighbours(b"s", list(reversed(range(30))), 6)[0] != ()
    assert neighbours(b"s", range(30), 6) is not neighbours(b"s", range(30), 6)
