"""Monitoring (docs/operations.md "Monitoring"): the operations exporter
(``exporter``), the rules renderer (``rules``), the Grafana dashboard as code (``dashboard``),
firing alerts for ``dsv41 status`` (``alerts``) and ``dsv41 monitor`` (``cli``)."""
