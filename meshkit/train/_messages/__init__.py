"""Every trainer message's schema, in one family: declared in one language, structured by one converter.

* :mod:`.fields` -- the schema language: bounds, value types, field
  declarations and the one cattrs converter (no coercion, no extra keys);
* :mod:`.trainer` -- what rank 0 asks a worker, and each reply;
* :mod:`.secure` -- the secure round's ``secagg_*`` messages;
* :mod:`.local_sgd` -- a DiLoCo replica's ``replica_*`` and ``inner`` messages;
* :mod:`.relay` -- what the coordinator asks a host relay, and its answers;
* :mod:`.check` -- where a message is checked as it enters (a reply where a
  pool takes it in, a request where a worker does), and a contribution
  against the round's model.

docs/protocol.md §4.1 and §7 tabulate these classes; tests parse the tables
and compare them with :func:`field_table`, so the page and the code cannot
drift apart.
"""

from __future__ import annotations

from meshkit.train._messages.check import (REPLIES, REQUESTS, Signature, check_contribution,
                                           check_reply, check_request, field_table, nonfinite_leaf,
                                           out_of_range_leaf,
                                           signature)
from meshkit.train._messages.fields import (MAX_BATCH, MAX_BUDGET, MAX_COUNT, MAX_ERROR,
                                            MAX_EXAMPLES, MAX_METRICS, MAX_NAME, MAX_SEED, MAX_SEQ,
                                            MAX_STATE_KEYS, MIN_SEQ, Metrics, State)
from meshkit.train._messages.local_sgd import LOCAL_SGD_REPLIES, LOCAL_SGD_REQUESTS
from meshkit.train._messages.secure import MAX_CLIENT_ID
from meshkit.train._messages.trainer import ErrorReply

__all__ = ["REQUESTS", "REPLIES", "LOCAL_SGD_REQUESTS", "LOCAL_SGD_REPLIES", "ErrorReply", "Signature", "check_request", "check_reply",
           "check_contribution", "nonfinite_leaf", "out_of_range_leaf", "signature", "field_table", "State", "Metrics",
           "MAX_CLIENT_ID", "MAX_BATCH", "MAX_BUDGET", "MAX_COUNT", "MAX_ERROR",
           "MAX_EXAMPLES", "MAX_METRICS", "MAX_NAME", "MAX_SEED", "MAX_SEQ", "MAX_STATE_KEYS",
           "MIN_SEQ"]
