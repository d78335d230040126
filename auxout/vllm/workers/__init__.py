"""The worker processes: auxout's worker classes, the router capture and the layer topology."""
