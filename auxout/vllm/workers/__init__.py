"""The worker processes: auxout's worker classes, the router capture, the layer topology and
the step output that resolves asynchronously."""
