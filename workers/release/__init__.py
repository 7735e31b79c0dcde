"""Released checkpoints in and trained checkpoints out, one module per published layout.

``layouts`` finds which layout a folder holds and dispatches; ``lerobot_pi``,
``transformers_pi0`` and ``vla_release`` (GR00T N1.5, OpenVLA-OFT) each read and write their
layouts; ``normalize`` turns a release's statistics into the state/action affine maps the
policies apply; ``export`` writes a run folder's trained policy in its family's own format.
See docs/checkpoints.md.
"""
