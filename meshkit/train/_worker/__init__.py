"""A worker's side of a run: a task answering the coordinator's requests.

* :mod:`.trainer` -- :class:`Trainer`, every trainer request answered;
* :mod:`.secure` -- the clients a worker plays in a secure round;
* :mod:`.node_job` -- the node's ``"train"`` job: a rank serving one training spec.
"""
