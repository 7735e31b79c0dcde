"""The harness tests and benches share, above the front door: start a job through the real
launcher and watch it (``jobs``), hosts in network namespaces (``netns``), the benches' clocks,
histograms and output (``bench``) and the echo peers they measure the broker with (``echo``)."""
