"""Observing a running cluster: metrics, call times, traces, `colobus top`."""
