"""The front door: the ``rlvla3`` command line, ``rlvla3 eval``, the launcher and the run controller.

It sits above the rooms (``brokers``, ``workers``) and imports them; nothing below imports it.
"""
