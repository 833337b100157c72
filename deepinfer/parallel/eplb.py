"""MoE expert placement over devices (the EPLB recipe: replicate the heaviest, then balanced packing).

Input: one layer's recorded expert loads (tokens routed to each expert, ``CausalLM.moe_stats()``).
Each device has ``slots`` expert slots: ``num_experts / num_devices`` for the experts themselves plus
``extra`` for replicas (DeepSeek-V4.1 Flash serving: 6 + 1 hot replica per card). Two steps:

1. **Replicate**: each extra slot goes, one at a time, to the expert whose per-replica load
   (load / copies) is the largest now; a token of an expert with ``c`` copies goes to one of them
   (round-robin by token), so each copy carries ``load / c``.
2. **Pack**: the copies, heaviest first, each go to the least-loaded device that still has a
   free slot (the longest-processing-time rule with a capacity per device).

No tensors and no torch: the same code plans placements offline from saved statistics.
Imbalance is ``max / mean`` of the per-device loads (1.0 is perfect).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """Where the copies of a layer's experts live."""

    devices: tuple[tuple[int, ...], ...]  # per device: the expert id of each slot
    copies: tuple[int, ...]  # per expert: how many devices hold it

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    def device_loads(self, loads: list[float]) -> list[float]:
        """Per-device load when every copy of expert e serves loads[e] / copies[e]."""
        return [sum(loads[e] / self.copies[e] for e in slots) for slots in self.devices]

    def imbalance(self, loads: list[float]) -> float:
        per_device = self.device_loads(loads)
        mean = sum(per_device) / len(per_device)
        return max(per_device) / mean if mean else 1.0

    def replica_of(self, expert: int, token: int) -> int:
        """Device that serves ``token``'s route to ``expert`` (round-robin over its copies)."""
        k = token % self.copies[expert]
        for d, slots in enumerate(self.devices):
            n = slots.count(expert)
            if k < n:
                return d
            k -= n
        raise ValueError(f"expert {expert} has no copy")


def contiguous_placement(num_experts: int, num_devices: int) -> Placement:
    """The static layout: experts in order, ``num_experts / num_devices`` per device, no replicas."""
    per = _per_device(num_experts, num_devices)
    return Placement(tuple(tuple(range(d * per, (d + 1) * per)) for d in range(num_devices)),
                     (1,) * num_experts)


def balanced_placement(loads: list[float], num_devices: int, extra: int = 1) -> Placement:
    """``extra`` replica slots per device given to the heaviest experts, then balanced packing."""
    num_experts = len(loads)
    slots = _per_device(num_experts, num_devices) + extra
    copies = [1] * num_experts
    heap = [(-load, e) for e, load in enumerate(loads)]  # max-heap of per-copy load
    heapq.heapify(heap)
    for _ in range(extra * num_devices):
        _, e = heapq.heappop(heap)
        copies[e] += 1
        heapq.heappush(heap, (-loads[e] / copies[e], e))
    items = sorted(((loads[e] / copies[e], e) for e in range(num_experts) for _ in range(copies[e])),
                   key=lambda item: (-item[0], item[1]))
    devices: list[list[int]] = [[] for _ in range(num_devices)]
    device_load = [0.0] * num_devices
    for load, e in items:
        # least-loaded device with a free slot that does not hold this expert yet (a second copy
        # on the same device would not spread its load); ties by index, so the result is stable
        open_devices = [d for d in range(num_devices) if len(devices[d]) < slots and e not in devices[d]]
        if not open_devices:
            open_devices = [d for d in range(num_devices) if len(devices[d]) < slots]
        d = min(open_devices, key=lambda d: (device_load[d], d))
        devices[d].append(e)
        device_load[d] += load
    return Placement(tuple(tuple(s) for s in devices), tuple(copies))


def _per_device(num_experts: int, num_devices: int) -> int:
    if num_devices < 1 or num_experts % num_devices:
        raise ValueError(f"{num_experts} experts do not split evenly over {num_devices} devices")
    return num_experts // num_devices


@dataclass(frozen=True)
class ImbalanceReport:
    layer: int
    before: float  # contiguous placement
    after: float  # balanced placement with replicas


def placement_report(moe_stats: dict, num_devices: int, extra: int = 1) -> list[ImbalanceReport]:
    """Imbalance before and after EPLB for every MoE layer of ``CausalLM.moe_stats()`` (totals)."""
    out = []
    for layer, stats in sorted(moe_stats["layers"].items()):
        loads = [float(c) for c in stats["total"]]
        before = contiguous_placement(len(loads), num_devices).imbalance(loads)
        after = balanced_placement(loads, num_devices, extra).imbalance(loads)
        out.append(ImbalanceReport(layer, before, after))
    return out
