"""Three third-party plugins, each correct, and the mistakes planted in them.

``clipped_mean`` (an aggregator), ``dense_board`` (a board driver) and
``csv_log`` (an observer) are written as a plugin author would, from the docs,
with meshkit's public API only; each passes its contract suite. Every entry
of their ``MISTAKES`` is that plugin with one real mistake, the kind
plugin authors ship (issue 33 lists the 27 the kit must catch).
"""
