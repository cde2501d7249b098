"""The bench layer: the benchmark run (run), the roofline (roofline), the machine (system) and the
report (tables and plot)."""
