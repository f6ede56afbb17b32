"""The coordinator's side of a run: from a config to a finished run (``meshkit run``).

* :mod:`.plan` -- what a config resolves to: every component chosen, its options checked;
* :mod:`.preflight` -- everything refused before any process starts;
* :mod:`.launch` -- the worker processes a local run starts;
* :mod:`.blas` -- the coordinator's BLAS pool beside them: one thread;
* :mod:`.runner` -- the run itself: nodes, pools, the strategy, checkpoints;
* :mod:`.resume` -- what a run may do with the out directory it finds;
* :mod:`.artifacts` -- metrics, summary and plot in the out directory;
* :mod:`.progress` -- how progress reads; :mod:`.observers` -- who is told.
"""
