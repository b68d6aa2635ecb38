"""The 8-bit dynamic (tree) quantization maps of `optim.formats.Blockwise8bit`, as tuples and tensors.

The 256 values of each map (signed for m, unsigned for v), the tensors a step decodes and encodes
with (built once per device, or as graph constants when compiled), and the lookup tables that
let the native kernels encode without a search.
"""

from __future__ import annotations

import functools
import itertools
import math
import weakref

import torch

from ..compiling import constant

__all__ = ["MAPS", "dynamic_map", "dynamic_map_lookup", "map_tensors"]

F32 = torch.float32


@functools.cache
def dynamic_map(signed: bool) -> tuple[float, ...]:
    """The 256 values of the 8-bit dynamic (tree) quantization map, ascending.

    A code spends its leading bits on a decimal exponent and the rest on a linear fraction:
    level e (0 … 6) covers magnitudes 10^(e−6)·[0.1, 1] with 2^e (signed) or 2^(e+1)
    (unsigned) values at the midpoints of an even split of [0.1, 1], so small magnitudes get
    few, widely spaced codes and the top decade most of them. With 0 and 1 that is 2·127 + 2
    codes signed, 254 + 2 unsigned (the signed map has +1 but not −1: a block's most negative
    element, when it holds the absmax, lands on the top midpoint, 0.7% short). Relative spacing in the top decade: 1/128 (signed) and
    1/256 (unsigned) of the block maximum.
    """
    values = {0.0, 1.0}
    for level in range(7):
        count = 2**level if signed else 2 ** (level + 1)
        edges = [0.1 + 0.9 * i / count for i in range(count + 1)]
        for low, high in itertools.pairwise(edges):
            magnitude = 10.0 ** (level - 6) * (low + high) / 2
            values.add(magnitude)
            if signed:
                values.add(-magnitude)
    ordered = sorted(values)
    if len(ordered) != 256:
        raise AssertionError(f"dynamic map has {len(ordered)} codes, expected 256")
    return tuple(ordered)


# Both maps, as plain tuples read at import.
MAPS = {signed: dynamic_map(signed) for signed in (True, False)}


# The same values as the bit patterns of their FP32 roundings, from which every map tensor is
# built: a compiled step builds it as a graph constant (a cached builder would be traced through
# its cache). Dynamo makes a global float a graph input, handed in at every call (256 of them,
# stacked back into a tensor: about 1,500 Inductor nodes per map, and collage-8bit's step took a
# minute and a half to compile); a global int it reads as a constant, so the map is one tensor.
_MAP_BITS = {
    signed: tuple(torch.tensor(values, dtype=F32).view(torch.int32).tolist()) for signed, values in MAPS.items()
}


def _buildmap_tensors(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    values = torch.tensor(_MAP_BITS[signed], dtype=torch.int32, device=device).view(F32)
    return values, (values[1:] + values[:-1]) / 2


# Eagerly, the map tensors are built once per (map, device) — once per fake mode for tensors of a
# FakeTensorMode — so that a step makes no copy from the host; a compiled step builds them from
# the tuples instead, as graph constants.
_map_cache: dict[tuple[bool, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
_fake_map_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def map_tensors(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The map's values and the midpoints between neighbours (the rounding boundaries)."""
    if torch.compiler.is_compiling():
        return _buildmap_tensors(signed, device)
    fake_mode = torch._guards.detect_fake_mode()
    cache = _map_cache if fake_mode is None else _fake_map_cache.setdefault(fake_mode, {})
    key = (signed, torch.device(device))
    if key not in cache:
        cache[key] = _buildmap_tensors(signed, device)
    return cache[key]


@constant
def dynamic_map_lookup(signed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Tables that encode into the dynamic map without a search (the native kernels use them).

    Returns (values, midpoints, lookup, nan_code): the 256 FP32 values; the 255 FP32 midpoints
    and a +inf sentinel; for each 16-bit key (the top half of an FP32's bits) the number of
    midpoints below every float with that key (uint8, 65536 entries and 3 bytes of padding for
    4-byte gathers); the code of NaN. The code of x is lookup[key] + (x > midpoints[lookup[key]]),
    `torch.bucketize(x, midpoints)` exactly: at most one midpoint lies among the floats of a key
    (checked here) and it is the next one above the counted ones.
    """
    values, midpoints = map_tensors(signed, torch.device("cpu"))
    keys = torch.arange(1 << 16, dtype=torch.int64)
    first = (keys << 16).to(torch.int32).view(F32)  # the key's floats with the low half 0 ...
    last = ((keys << 16) | 0xFFFF).to(torch.int32).view(F32)  # ... and 0xFFFF
    negative = keys >= 0x8000
    low, high = torch.where(negative, last, first), torch.where(negative, first, last)
    lookup = torch.searchsorted(midpoints, low.nan_to_num(nan=math.inf, posinf=math.inf))
    inside = torch.searchsorted(midpoints, high) - lookup
    valid = ~(low.isnan() | high.isnan())
    if bool((inside[valid] > 1).any()):
        raise AssertionError("dynamic map: two midpoints share a 16-bit key; the lookup cannot encode it")
    lookup = torch.where(low.isnan(), 0, lookup)  # NaN keys: the kernels take nan_code instead
    nan_code = int(torch.bucketize(torch.tensor([math.nan]), midpoints))
    padded = torch.cat([lookup.to(torch.uint8), torch.zeros(3, dtype=torch.uint8)])
    mids = torch.cat([midpoints, torch.tensor([math.inf])])
    return values, mids, padded, nan_code
