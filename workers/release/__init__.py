"""Released checkpoints in and trained checkpoints out, one module per published layout.

``layouts`` finds which layout a folder holds and dispatches; ``lerobot_pi``,
``transformers_pi0``, ``gr00t_n15`` and ``openvla_oft`` each read and write their layouts and
build the family's policy; ``normalize`` turns a release's statistics into the state/action
affine maps the policies hold. Layouts import policies, never the reverse. See
docs/checkpoints.md.
"""
