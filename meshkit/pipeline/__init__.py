"""Pipelined inference driven by the coordinator: stages, placement, streaming.

A pipeline is an ordered list of :class:`Stage` objects. The coordinator
places each on a rank whose :class:`~meshkit.NodeCaps` accept it
(:func:`place`), ships each rank its stage, streams activations into the
first one with several in flight, and collects the last stage's outputs in
order (:func:`run_pipeline`). On each worker, :func:`serve_pipeline_job`
(the node's ``"pipeline"`` job handler) runs the stage it was shipped.

Where each idea lives: ``_stages.py`` (:class:`Stage`, its ops, its wire
form, :func:`run_local`), ``_placement.py`` (:func:`place`,
:func:`place_training`), ``_streaming.py`` (:func:`run_pipeline`), and
``_serve.py`` (the worker side: :func:`serve_worker`,
:func:`serve_pipeline_job`).

Stages a worker runs (this release keeps them simple; weights travel in the
job message as arrays):

=============  ===============================================================
``identity``   ``y = x``
``scale``      ``y = scale * x``
``relu``       ``y = max(x, 0)``
``tanh``       ``y = tanh(x)``
``affine``     ``y = x @ weights (+ bias)``, then ``activation`` (relu/tanh)
               if set; ``weights`` has shape (in, out)
``call``       ``y = f(x)`` for ``function = "module:function"``, imported on
               the worker (the coordinator is authenticated by the shared
               secret; the module must be installed on the worker)
``None``       a *board stage*: only a fixed-function rank whose descriptor
               has this ``stage_id`` can run it (:meth:`Stage.board`)
=============  ===============================================================

Activations are 1-D float32 vectors (inputs are flattened), as on
fixed-function hardware, whose host links exchange f32.

Placement rules (checked before any activation moves, each refusal a
:class:`~meshkit.PlacementError`):

* a fixed-function rank only ever gets the stage its board implements;
* a board stage goes to a free fixed-function rank implementing its
  ``stage_id``; none -> refused, naming the stage and the boards present;
* any other stage goes to a free worker rank (lowest rank first); with
  ``ranks=`` given explicitly, every (stage, rank) pair is checked;
* :func:`place_training` refuses a training job that would include a
  fixed-function rank (:meth:`NodeCaps.check_train` says why).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshkit._lazy import on_first_use

if TYPE_CHECKING:
    from meshkit.pipeline._placement import Placement, place, place_training
    from meshkit.pipeline._serve import serve_pipeline_job, serve_worker
    from meshkit.pipeline._stages import OPS, Stage, run_local
    from meshkit.pipeline._streaming import BATCH_BYTES, PipelineResult, run_pipeline

#: Where each public name lives, imported on first use (a training node never needs the
#: pipeline's coordinator side; every process a run starts paid for all of it:
#: docs/benchmarks.md, "ci2"). The imports above are the same names for the type
#: checker (tests/kernel/test_lazy_imports.py keeps the two in step).
_WHERE: dict[str, str] = {
    "Placement": "meshkit.pipeline._placement",
    "place": "meshkit.pipeline._placement",
    "place_training": "meshkit.pipeline._placement",
    "serve_pipeline_job": "meshkit.pipeline._serve",
    "serve_worker": "meshkit.pipeline._serve",
    "OPS": "meshkit.pipeline._stages",
    "Stage": "meshkit.pipeline._stages",
    "run_local": "meshkit.pipeline._stages",
    "BATCH_BYTES": "meshkit.pipeline._streaming",
    "PipelineResult": "meshkit.pipeline._streaming",
    "run_pipeline": "meshkit.pipeline._streaming",
}

__all__ = [
    "OPS",
    "BATCH_BYTES",
    "Stage",
    "Placement",
    "PipelineResult",
    "place",
    "place_training",
    "run_pipeline",
    "run_local",
    "serve_worker",
    "serve_pipeline_job",
]


if not TYPE_CHECKING:  # the type checker reads the imports above instead
    __getattr__, __dir__ = on_first_use(__name__, _WHERE, globals())
