"""Elastic training: the driver's state machine over formations (``driver``), its pure policy
(``policy``), the Ray side that runs and watches one formation (``formation``), and the job's
side of the shared autoscaler (``training_shell``)."""
