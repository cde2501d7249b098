"""The evaluation layer: measures (metrics) and the parity gates against a reference backend (parity)."""
