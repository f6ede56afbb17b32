"""A host relay's side (``meshkit relay``): it serves the coordinator's requests on its own ranks.

* :mod:`.host` -- its pool over its ranks and its answers to ``fold`` and ``fanout``;
* :mod:`.secure` -- its part in a secure round: the sum of its ranks' masked vectors;
* :mod:`.grid` -- its part in a grid round (``[compression] clip_range``): the exact
  integer sum of its ranks' sums of codes;
* :mod:`.pull` -- the pull both sums gather by: one request a rank, each reply taken or lost.
"""
