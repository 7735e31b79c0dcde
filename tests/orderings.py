"""A user-defined ordering function, named in configs as ``tests.orderings:newest_first``."""


def newest_first(request):
    return -request.arrival


def explodes(request):
    """An ordering function with a bug: the broker must answer, log and go on."""
    raise RuntimeError("bug in a user ordering function")
