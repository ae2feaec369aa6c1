"""A training job's health: pure policies for slow ranks, hung collectives and loss anomalies
(``policy``), and the live monitor that feeds them from a running job (``monitor``)."""
