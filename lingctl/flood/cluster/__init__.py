"""flood on a Ray cluster: the only part of lingctl that imports Ray (an optional extra, ``lingctl[ray]``)."""
