"""A user-defined ordering function, named in configs as ``tests.orderings:newest_first``."""


def newest_first(request):
    return -request.arrival
