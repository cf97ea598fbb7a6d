"""Disjoint SM partitions (green contexts), MPS workers, and device facts.

``Partitioner`` carves a GPU into disjoint SM partitions whose streams confine captured graphs;
on CPU it returns no-op partitions. ``gpuloom.gpu.mps`` runs one process per partition under MPS.
torch and ``cuda.bindings`` are imported only when a GPU partition is made.
"""

from .connections import prefer_all_connections
from .device import DeviceFacts, device_facts, max_blocks_per_sm, sm_granularity, sm_grid
from .errors import BindingsMissingError, DriverError, GpuError, NoGpuError, PartitionError
from .partition import Partition, Partitioner, carve_order, validate_layout

__all__ = [
    "BindingsMissingError", "DeviceFacts", "DriverError", "GpuError", "NoGpuError", "Partition",
    "PartitionError", "Partitioner", "device_facts", "max_blocks_per_sm", "sm_granularity", "sm_grid",
    "prefer_all_connections", "validate_layout", "carve_order",
]
