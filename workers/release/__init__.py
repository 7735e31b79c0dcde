"""Released checkpoints in and trained checkpoints out, one module per published layout.

``layouts`` finds which layout a folder holds and loads it; ``lerobot_pi``, ``transformers_pi0``,
``gr00t_release`` and ``openvla_oft_release`` each read and write one family's layout;
``normalize`` turns a release's statistics into the state/action affine maps the policies apply;
``export`` writes a run folder's trained policy in its family's own format.
"""
