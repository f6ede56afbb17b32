"""How a round is played: the skeleton every strategy shares, and one module per round path.

* :mod:`.skeleton` -- check stop, clock, play the round, report (:func:`run_rounds`);
* :mod:`.work` -- what every path takes and gives back (``Work``, ``Folded``);
* :mod:`.engine` -- :func:`fold_round`, which picks the round's path, and the flat round;
* :mod:`.scheduler` -- the one scheduler the flat and the batched round play on;
* :mod:`.batched` -- each worker folds its clients exactly, one partial each;
* :mod:`.collective` -- every rank plays its slice, one all-reduce (no coordinator);
* :mod:`.relayed` -- host relays fold their ranks' contributions;
* :mod:`.secure` -- secure aggregation: the coordinator learns only the sum;
* :mod:`.compressed` -- a compressed round's fits and decoder (it plays flat).
"""
