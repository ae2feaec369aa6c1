"""The shared autoscaler: its vocabulary (``types``), the pure policy (``policy``, lending in
``lending``), the controller-side loop (``loop``) and home (``service``), and the skeleton the
training and Serve shells stand on (``shell``)."""
