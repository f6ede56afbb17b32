"""Placement: every refusal happens before any job or activation moves."""

from __future__ import annotations

import numpy as np
import pytest

from meshkit import FixedFunction, PlacementError
from meshkit.node import local_caps
from meshkit.pipeline import Stage, place, place_training, run_pipeline


ENC = FixedFunction("enc0", 8, 4)
CAPS = [local_caps(1), local_caps(2, fixed_function=ENC), local_caps(3)]


class SpyGroup:
    """Records every send; a placement refusal must leave it empty."""

    rank, world_size, timeout = 0, 4, 1.0

    def __init__(self) -> None:
        self.sent: list[tuple[int, int, dict]] = []

    def send(self, dst, tag, payload):
        self.sent.append((dst, tag, dict(payload)))

    def recv(self, src, tag, timeout=None):
        raise AssertionError("nothing should be received")


def test_stages_are_placed_where_caps_accept_them():
    stages = [Stage(op="relu"), Stage.board("enc0"), Stage(op="identity")]
    placement = place(stages, CAPS)
    assert placement.ranks == (1, 2, 3)
    assert placement.route(0) == (0, 2) and placement.route(1) == (1, 3)
    assert placement.route(2) == (2, 0)
    assert placement.describe() == ("relu stage -> rank 1, board stage [enc0] -> rank 2, "
                                    "identity stage -> rank 3")


def test_a_fixed_function_rank_only_ever_gets_its_own_stage():
    # Three worker stages, two workers: the board is never used as a spare CPU.
    with pytest.raises(PlacementError) as err:
        place([Stage(op="relu")] * 3, CAPS)
    assert str(err.value) == (
        "no free worker rank for relu stage (stage 3 of 3): 3 rank(s) joined, "
        "fixed-function ranks run only their own stage; start more workers")


def test_a_stage_no_board_implements_is_refused_at_placement_before_anything_moves():
    group = SpyGroup()
    with pytest.raises(PlacementError) as err:
        run_pipeline(group, [Stage(op="relu"), Stage.board("dec9")], CAPS, [np.zeros(8)])
    assert str(err.value) == (
        "no rank can run board stage [dec9]: no fixed-function rank implements it "
        "(rank 2 implements [enc0]). Start a node with a board implementing [dec9], or "
        "give the stage an op a worker can run")
    assert group.sent == []


def test_a_board_stage_needs_a_board_of_its_own():
    with pytest.raises(PlacementError, match=r"rank\(s\) \[2\] implementing it already run "
                                             r"an earlier stage"):
        place([Stage.board("enc0"), Stage.board("enc0")], CAPS)
    with pytest.raises(PlacementError, match="no fixed-function rank joined"):
        place([Stage.board("enc0")], [local_caps(1)])


def test_explicit_ranks_are_checked_against_the_caps():
    with pytest.raises(PlacementError) as err:
        place([Stage.board("dec1")], CAPS, ranks=[2])
    assert str(err.value) == (
        "rank 2: fixed-function rank implements stage [enc0], cannot run [dec1]: an FPGA "
        "datapath is synthesized, not compiled")
    with pytest.raises(PlacementError, match=r"carries no stage_id: set stage_id"):
        place([Stage(op="relu")], CAPS, ranks=[2])
    with pytest.raises(PlacementError, match=r"placed on rank 1, a worker: it runs only on a "
                                             r"fixed-function rank implementing it"):
        place([Stage.board("enc0")], CAPS, ranks=[1])
    with pytest.raises(PlacementError, match=r"rank 7, which has not announced"):
        place([Stage(op="relu")], CAPS, ranks=[7])
    with pytest.raises(PlacementError, match="give one rank per stage"):
        place([Stage(op="relu")], CAPS, ranks=[1, 3])
    assert place([Stage(op="relu"), Stage.board("enc0")], CAPS, ranks=[3, 2]).ranks == (3, 2)


def test_a_training_job_that_would_include_a_fixed_function_rank_is_refused():
    assert place_training(CAPS, ranks=[1, 3]) == [1, 3]
    with pytest.raises(PlacementError) as err:
        place_training(CAPS)
    assert str(err.value).startswith(
        "rank 2 is a fixed-function rank implementing the pre-synthesized stage [enc0] and "
        "cannot train: its datapath has no backward pass, and a rank that never joins the "
        "reduce stalls every rank that does")
