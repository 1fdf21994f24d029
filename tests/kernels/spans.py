"""What a retention policy (cache.Retention) means to the paged decode kernels, for their tests."""


def visible_span(retention, seq_lens) -> dict:
    """The paged kernels' keyword arguments for a retention policy (None: every key)."""
    if retention is None or retention.keeps_all:
        return {}
    return dict(starts=retention.span_starts(seq_lens), sinks=retention.sinks, max_keys=retention.visible_capacity,
                stride=retention.dilation)


def sees(position: int, query: int, retention) -> bool:
    """The policies' definitions, written out plainly for the float64 loops (cache/retention.py is under test)."""
    if retention is None or position > query:
        return position <= query
    if retention.chunk is not None:
        return position // retention.chunk == query // retention.chunk
    if retention.window is None:
        return True
    back = query - position
    seen = back % retention.dilation == 0 and back // retention.dilation < retention.window
    return seen or position < retention.sinks
