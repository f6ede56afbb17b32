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

from meshkit.pipeline._placement import Placement, place, place_training
from meshkit.pipeline._serve import serve_pipeline_job, serve_worker
from meshkit.pipeline._stages import OPS, Stage, run_local
from meshkit.pipeline._streaming import BATCH_BYTES, PipelineResult, run_pipeline

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
