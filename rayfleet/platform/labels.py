"""The node-label scheme: how a node says where it sits in the fleet.

Every rayfleet node carries these Ray node labels (Kubernetes label syntax, ``prefix/name``):

| key                              | example     | meaning                                      |
|----------------------------------|-------------|----------------------------------------------|
| ``rayfleet.io/node``             | ``n0003``   | node name, unique in the fleet               |
| ``rayfleet.io/accelerator-type`` | ``H100``    | catalogue key of the node's accelerators     |
| ``rayfleet.io/num-accelerators`` | ``8``       | accelerators on the node (index = rail)      |
| ``rayfleet.io/rack``             | ``r01``     | rack (one top-of-rack switch)                |
| ``rayfleet.io/block``            | ``b0``      | block/pod (one spine group)                  |
| ``rayfleet.io/nvlink-domain``    | ``nvl-n0003``| scale-up domain (NVLink, XPU super-node)    |
| ``rayfleet.io/role``             | ``head``    | ``head`` or ``worker``                       |
| ``ray.io/accelerator-type``      | ``H100``    | Ray's own key, set too so Ray tools see it   |

Each node also declares its accelerators as the catalogue's Ray resource (``GPU``, ``NPU``,
``XPU``) and one resource per accelerator slot, ``rayfleet_slot_<i>`` (amount 1), so that a
placement bundle can ask for *exactly* accelerator index ``i`` — the rail.
"""

from __future__ import annotations

import re

from rayfleet.errors import LabelError

__all__ = [
    "PREFIX", "NODE", "ACCELERATOR_TYPE", "NUM_ACCELERATORS", "RACK", "BLOCK", "NVLINK_DOMAIN",
    "ROLE", "RAY_ACCELERATOR_TYPE", "REQUIRED_KEYS", "slot_resource", "validate_label",
]

PREFIX = "rayfleet.io/"
NODE = PREFIX + "node"
ACCELERATOR_TYPE = PREFIX + "accelerator-type"
NUM_ACCELERATORS = PREFIX + "num-accelerators"
RACK = PREFIX + "rack"
BLOCK = PREFIX + "block"
NVLINK_DOMAIN = PREFIX + "nvlink-domain"
ROLE = PREFIX + "role"
RAY_ACCELERATOR_TYPE = "ray.io/accelerator-type"
REQUIRED_KEYS = (NODE, ACCELERATOR_TYPE, NUM_ACCELERATORS, RACK, BLOCK, NVLINK_DOMAIN, ROLE)

_SLOT_PREFIX = "rayfleet_slot_"
_VALUE = re.compile(r"^([A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?)?$")
_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$")
_PREFIX_PART = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$")


def slot_resource(index: int) -> str:
    """Ray resource name that stands for accelerator slot (rail) ``index`` on a node."""
    return f"{_SLOT_PREFIX}{index}"


def slot_index(resource: str) -> int | None:
    """Inverse of :func:`slot_resource`; ``None`` for other resources."""
    if resource.startswith(_SLOT_PREFIX) and resource[len(_SLOT_PREFIX):].isdigit():
        return int(resource[len(_SLOT_PREFIX):])
    return None


def validate_label(key: str, value: str, *, where: str = "label") -> None:
    """Raise :class:`LabelError` unless ``key=value`` is a valid Ray/Kubernetes node label."""
    prefix, _, name = key.rpartition("/")
    if not _NAME.match(name or "") or (prefix and (len(prefix) > 253 or not _PREFIX_PART.match(prefix))):
        raise LabelError(
            f"{where}: key {key!r} is not a valid label key. Fix: use 'prefix/name' where name is "
            "1-63 characters of letters, digits, '-', '_' or '.', starting and ending with a "
            "letter or digit (for example 'rayfleet.io/rack')"
        )
    if not isinstance(value, str) or not _VALUE.match(value):
        raise LabelError(
            f"{where}: value {value!r} of label {key!r} is not a valid label value. Fix: use at "
            "most 63 characters of letters, digits, '-', '_' or '.', starting and ending with a "
            "letter or digit (for example 'r01')"
        )


def parse_label_string(text: str, *, where: str = "--labels") -> dict[str, str]:
    """Parse ``"k=v,k2=v2"`` (the form ``ray start --labels`` takes) and validate every pair."""
    labels: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise LabelError(f"{where}: {item!r} has no '='. Fix: write labels as 'key=value,key2=value2'")
        validate_label(key.strip(), value.strip(), where=where)
        labels[key.strip()] = value.strip()
    return labels


def format_label_string(labels: dict[str, str]) -> str:
    """The ``ray start --labels`` form of ``labels`` (validated)."""
    for key, value in labels.items():
        validate_label(key, value)
    return ",".join(f"{k}={v}" for k, v in labels.items())
