"""Elastic depth (spec §10, §U f): the depth-D rung of a full-depth Needle 3 file.

Every depth 2 … L is a trained sub-network. The layer order is a bisection of [0, L − 1];
a rung keeps the first D layers of it, in ascending order. Run at a rung, a full-depth file
computes exactly what upstream's rung file (``needle build --layers D``) computes: the kept
blocks renumbered 0 … D − 1 (global layers and Engram sites follow their block), the mHC
active lane is the block's new index mod n, φ rows and mHC scalars are those of the kept
blocks, and each probe head reads cells 0 and l + 1 of every kept block l.

Pure Python (runs in the browser): ``rung(geometry, depth)`` describes what to select; the
reference and the GPU model select it from the weights they already hold (no copy on the GPU).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace

from ..errors import DepthError
from ..formats.needle3_geometry import Needle3Geometry


def ladder_order(layers: int) -> tuple:
    """§10: start with [0, L − 1], then split the widest gap at its midpoint (ties: leftmost).

    L = 20 gives 0, 19, 9, 14, 4, 6, 11, 16, 2, 7, 12, 17, 1, 3, 5, 8, 10, 13, 15, 18.
    """
    if layers <= 0:
        return ()
    if layers == 1:
        return (0,)
    order, kept = [0, layers - 1], [0, layers - 1]
    while len(order) < layers:
        gaps = [(kept[i + 1] - kept[i], -i) for i in range(len(kept) - 1)]
        width, neg = max(gaps)
        i = -neg
        if width < 2:  # no gap left to split (cannot happen before all layers are in)
            break
        middle = (kept[i] + kept[i + 1]) // 2
        order.append(middle)
        kept.insert(i + 1, middle)
    return tuple(order)


@dataclass(frozen=True)
class Rung:
    """What a depth-D run of a full-depth file selects.

    ``blocks[i]`` is the stored layer that runs as block i; ``cells[c]`` the cell of the full
    model that the rung's cell c is (0, then blocks[i] + 1); ``geometry`` is the rung's own
    (num_layers D, global layers and Engram sites renumbered, as in upstream's rung file);
    ``sites[s]`` is the stored Engram site that runs as the rung's site s.
    """

    depth: int
    blocks: tuple
    cells: tuple
    sites: tuple
    geometry: Needle3Geometry
    parent: Needle3Geometry

    @property
    def full(self) -> bool:
        return self.depth == self.parent.num_layers


def check_depth(depth, layers: int) -> int:
    """The depth as an int in [2, L] (or L itself for a one-layer file); anything else is a
    ``DepthError``: a depth the file cannot give is refused, never saturated (issue: a rung
    is a different model, not a rounded request)."""
    if isinstance(depth, bool):
        raise DepthError(f"depth must be a whole number of layers, got {depth!r}")
    try:
        value = operator.index(depth)
    except TypeError:
        raise DepthError(f"depth must be a whole number of layers, got {depth!r}") from None
    low = min(2, layers)
    if not low <= value <= layers:
        raise DepthError(f"depth {value}: this file's ladder has rungs {low} to {layers} (spec §10)")
    return value


def rung(geometry: Needle3Geometry, depth) -> Rung:
    """The depth-``depth`` rung of a full-depth file of this geometry (§U f)."""
    g = geometry
    depth = check_depth(depth, g.num_layers)
    blocks = tuple(sorted(ladder_order(g.num_layers)[:depth]))
    new_index = {stored: i for i, stored in enumerate(blocks)}
    sites = tuple(s for s, layer in enumerate(g.engram_sites) if layer in new_index)
    sub = replace(g, num_layers=depth,
                  global_layers=tuple(new_index[layer] for layer in g.global_layers if layer in new_index),
                  engram_sites=tuple(new_index[g.engram_sites[s]] for s in sites))
    return Rung(depth, blocks, (0,) + tuple(b + 1 for b in blocks), sites, sub, g)


def full_rung(geometry: Needle3Geometry) -> Rung:
    """The identity selection: every layer, as stored."""
    layers = tuple(range(geometry.num_layers))
    return Rung(geometry.num_layers, layers, tuple(range(geometry.num_layers + 1)),
                tuple(range(len(geometry.engram_sites))), geometry, geometry)
