"""rayfleet: train and serve Mixture-of-Experts models on a shared, topology-aware Ray fleet.

Notebook entry point::

    import rayfleet
    fleet = rayfleet.connect()          # or rayfleet.connect(address="local")
    print(fleet.topology())
    fleet.print_status()
"""

from rayfleet.errors import RayfleetError

__version__ = "0.1.0"
__all__ = ["connect", "RayfleetError", "__version__"]


def connect(*args, **kwargs):
    """See :func:`rayfleet.sdk.connect`. Imported lazily so ``import rayfleet`` stays light."""
    from rayfleet.sdk import connect as _connect

    return _connect(*args, **kwargs)
