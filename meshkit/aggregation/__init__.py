"""The aggregator contract, the streaming fold, and the strict mean they share.

An *aggregator* combines contributions (states) into one state::

    aggregator.aggregate(states, weights=None) -> dict

and may offer the streaming form, which a coordinator uses to fold
contributions as they arrive with O(model) memory::

    fold = aggregator.begin()
    fold.add(state, weight, source="rank 3")   # once per contributor
    consensus = fold.result()

:func:`begin` gives a fold for *any* aggregator: the aggregator's own when it
has ``begin()``, else a :class:`BufferingFold` that keeps the contributions
and calls ``aggregate`` at ``result()`` (O(workers x model) memory, but a
plain third-party aggregator works everywhere); :func:`streaming` gives the
same choice as an aggregator with ``begin()``, for code that takes a
streaming aggregator. A
state given to ``add()`` belongs to the fold until ``result()`` returns:
folds may hold it by reference, so the caller must not modify it in between.

:class:`MeanFold` is the strict element-wise (weighted) mean behind the
built-in ``allreduce`` and ``fedavg``, public so a plugin can reuse it;
:func:`check_contributions` applies its rules without the arithmetic, for a
plain aggregator that computes something else.

Where each idea lives:

* ``_contract.py``: the protocols, :func:`check_weight`, :func:`default_source`,
  :func:`aggregate_by_folding`;
* ``_buffering.py``: :class:`BufferingFold`, :func:`begin`, :func:`streaming`;
* ``_mean.py``: :class:`MeanFold` and :func:`check_contributions`;
* ``_fixed.py``: :class:`FixedPointSum` and :class:`FixedPartial`, exact
  order-free weighted sums (a worker's local fold, merged anywhere);
* ``_json.py``: how JSON leaves are averaged and checked;
* ``_threads.py``: how a large fold is split across threads;
* ``_messages.py``: how refusals word values and contributor lists;
* ``_traits.py``: :class:`AggregatorTraits`, what an aggregator declares it is
  (the kernel decides by these, never by a name);
* ``_linear.py``: what a sum may stand in for (:func:`exact_mean`) and the
  refusal naming the missing ``linear`` trait (:func:`refuse_unless_linear`);
* ``_blocks.py``: outer gradients in 8 or 4 bits, blockwise, decoded to the same bits
  everywhere (:func:`encode_blocks`, :func:`decode_blocks`; DiLoCo's exchange), and
  their exact mean on one grid (:class:`GridSum`, :func:`on_grid`, :func:`sum_dtype`,
  :func:`mean_of_sum`: the star's fold and the ring's integer sum alike);
* ``_pieces.py``: a contribution cut into pieces (:func:`piece_plan`) and folded piece
  by piece into the strict mean's sum, one contribution at a time, with the bits of a
  ``retain = 0`` fold of whole contributions (:class:`PieceFold`, :func:`one_at_a_time`);
* ``_clip.py``: an update's L2 norm and norm clipping (:func:`global_norm`,
  :func:`clip_update`), shared by the robust rules and privacy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshkit._lazy import on_first_use

if TYPE_CHECKING:
    from meshkit.aggregation._buffering import (
        BufferingFold,
        begin,
        holds_every_contribution,
        streaming,
    )
    from meshkit.aggregation._blocks import BLOCK, OUTER_BITS, GridSum, decode_blocks, \
        encode_blocks, encoded_bytes, mean_of_sum, on_grid, sum_dtype
    from meshkit.aggregation._clip import clip_update, global_norm, squared_norm
    from meshkit.aggregation._contract import (
        Aggregator,
        Fold,
        StreamingAggregator,
        aggregate_by_folding,
        aggregator_state,
        check_weight,
        default_source,
        load_aggregator_state,
        uses_reference,
    )
    from meshkit.aggregation._fixed import (ContributionOutOfRange, DEFAULT_FRACTION_BITS, FixedPartial,
                                           FixedPointSum)
    from meshkit.aggregation._mean import CHUNK_ELEMENTS, MeanFold, check_contributions
    from meshkit.aggregation._threads import DEFAULT_THREADS
    from meshkit.aggregation._traits import AggregatorTraits, aggregator_traits, linear_weight
    from meshkit.aggregation._linear import exact_mean, refuse_unless_linear
    from meshkit.aggregation._pieces import (DEFAULT_PIECE_BYTES, PieceFold, float_layout,
                                             one_at_a_time, piece_plan)

#: Where each public name lives, imported on first use (a worker needs a few helpers,
#: not every fold; every process a run starts paid for all of it: docs/benchmarks.md,
#: "ci2"). The imports above are the same names for the type checker
#: (tests/kernel/test_lazy_imports.py keeps the two in step).
_WHERE: dict[str, str] = {
    "BufferingFold": "meshkit.aggregation._buffering",
    "begin": "meshkit.aggregation._buffering",
    "holds_every_contribution": "meshkit.aggregation._buffering",
    "streaming": "meshkit.aggregation._buffering",
    "BLOCK": "meshkit.aggregation._blocks",
    "OUTER_BITS": "meshkit.aggregation._blocks",
    "GridSum": "meshkit.aggregation._blocks",
    "decode_blocks": "meshkit.aggregation._blocks",
    "encode_blocks": "meshkit.aggregation._blocks",
    "encoded_bytes": "meshkit.aggregation._blocks",
    "mean_of_sum": "meshkit.aggregation._blocks",
    "on_grid": "meshkit.aggregation._blocks",
    "sum_dtype": "meshkit.aggregation._blocks",
    "clip_update": "meshkit.aggregation._clip",
    "global_norm": "meshkit.aggregation._clip",
    "squared_norm": "meshkit.aggregation._clip",
    "Aggregator": "meshkit.aggregation._contract",
    "Fold": "meshkit.aggregation._contract",
    "StreamingAggregator": "meshkit.aggregation._contract",
    "aggregate_by_folding": "meshkit.aggregation._contract",
    "aggregator_state": "meshkit.aggregation._contract",
    "check_weight": "meshkit.aggregation._contract",
    "default_source": "meshkit.aggregation._contract",
    "load_aggregator_state": "meshkit.aggregation._contract",
    "uses_reference": "meshkit.aggregation._contract",
    "ContributionOutOfRange": "meshkit.aggregation._fixed",
    "DEFAULT_FRACTION_BITS": "meshkit.aggregation._fixed",
    "FixedPartial": "meshkit.aggregation._fixed",
    "FixedPointSum": "meshkit.aggregation._fixed",
    "CHUNK_ELEMENTS": "meshkit.aggregation._mean",
    "MeanFold": "meshkit.aggregation._mean",
    "check_contributions": "meshkit.aggregation._mean",
    "DEFAULT_THREADS": "meshkit.aggregation._threads",
    "AggregatorTraits": "meshkit.aggregation._traits",
    "aggregator_traits": "meshkit.aggregation._traits",
    "linear_weight": "meshkit.aggregation._traits",
    "exact_mean": "meshkit.aggregation._linear",
    "refuse_unless_linear": "meshkit.aggregation._linear",
    "DEFAULT_PIECE_BYTES": "meshkit.aggregation._pieces",
    "PieceFold": "meshkit.aggregation._pieces",
    "float_layout": "meshkit.aggregation._pieces",
    "piece_plan": "meshkit.aggregation._pieces",
    "one_at_a_time": "meshkit.aggregation._pieces",
}

__all__ = [
    "BLOCK",
    "OUTER_BITS",
    "encode_blocks",
    "decode_blocks",
    "encoded_bytes",
    "GridSum",
    "mean_of_sum",
    "on_grid",
    "sum_dtype",
    "Fold",
    "Aggregator",
    "StreamingAggregator",
    "begin",
    "streaming",
    "aggregate_by_folding",
    "BufferingFold",
    "MeanFold",
    "check_weight",
    "check_contributions",
    "default_source",
    "CHUNK_ELEMENTS",
    "DEFAULT_THREADS",
    "global_norm",
    "clip_update",
    "uses_reference",
    "holds_every_contribution",
    "aggregator_state",
    "load_aggregator_state",
    "squared_norm",
    "FixedPointSum",
    "FixedPartial",
    "ContributionOutOfRange",
    "DEFAULT_FRACTION_BITS",
    "AggregatorTraits",
    "aggregator_traits",
    "linear_weight",
    "exact_mean",
    "refuse_unless_linear",
    "PieceFold",
    "piece_plan",
    "float_layout",
    "one_at_a_time",
    "DEFAULT_PIECE_BYTES",
]


if not TYPE_CHECKING:  # the type checker reads the imports above instead
    __getattr__, __dir__ = on_first_use(__name__, _WHERE, globals())
