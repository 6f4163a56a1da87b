"""Engram memory on the GPU (spec §4.2, §0 items 1, 4 and 5, §6 item 3).

Per chunk: ``fetch`` (one dispatch per site) hashes the raw token ids and gathers + prepares
the table rows into ``eh``; the existing ``cq.matmul`` on the [key_proj; value_proj] pack of
every site (``x_block_rows = 2d``) turns ``eh`` into ``ekv``; ``conv`` (one dispatch for all
sites) applies the dilated value convolution and keeps the raw values in a ring.

Reference functions: ``reference.needle3.engram.hash_indices``, ``hash_validity``, ``fetch`` (then
``reference.needle3.cq.prepare_input``) and ``value_conv``.
"""

from __future__ import annotations

from ...errors import DeviceLimitError, UnsupportedModelError
from ...formats.needle3_geometry import Needle3Geometry
from ...gpu.device import Binding, KernelKey, Plan, UniformArena
from ..cq import CODE_BITS, LEVEL_BASE, CQPack, fwht_scale
from .embed import workgroup_cap
from .fp16_store import Fp16Store

MAX_TABLES = 64  # workgroup slots for the per-table hash results (shipped: 6)
MAX_SITES = 16  # the header holds at most 16 sites (§8); the conv uniform has one tap offset each
MAX_ORDERS = 4  # the header holds at most 4 orders (§8)


def check(geometry: Needle3Geometry, group: int, workgroup_bytes: int) -> None:
    """What fetch and conv need of the geometry (called at load)."""
    g = geometry
    if len(g.engram_orders) > MAX_ORDERS or g.num_engram_tables > MAX_TABLES or len(g.engram_sites) > MAX_SITES:
        raise UnsupportedModelError(f"engram: {len(g.engram_orders)} orders / {g.num_engram_tables} tables / "
                                    f"{len(g.engram_sites)} sites (at most {MAX_ORDERS} / {MAX_TABLES} / {MAX_SITES})")
    if not 0 < g.engram_slots < 1 << 31:
        raise UnsupportedModelError(f"engram: {g.engram_slots} slots per table")
    row_pad = -(-g.engram_sub_dim // group) * group
    width = g.num_engram_tables * g.engram_sub_dim
    cap = workgroup_cap(g.num_engram_tables * row_pad, -(-width // group) * group)
    need = 4 * (cap + 16 + MAX_TABLES)
    if need > workgroup_bytes:
        raise UnsupportedModelError(f"engram fetch: {g.num_engram_tables} tables of rows padded to the group {group} "
                                    f"need {need} bytes of workgroup memory (the device has {workgroup_bytes})")


def _fetch_key(geometry: Needle3Geometry, tables: CQPack, entry: str, act_quant: bool = False,
               pad_mask: bool = False) -> KernelKey:
    g = geometry
    width = g.num_engram_tables * g.engram_sub_dim
    out_pad = -(-width // tables.group) * tables.group
    cap = workgroup_cap(g.num_engram_tables * tables.in_pad, out_pad)
    return KernelKey("engram", entry=entry, consts=(
        ("CODE_BITS", CODE_BITS[tables.bits]), ("LEVEL_BASE", LEVEL_BASE[tables.bits]), ("GROUP", tables.group),
        ("CAP", cap), ("FWHT_SCALE", fwht_scale(tables.group)), ("MAX_TABLES", MAX_TABLES),
        ("ACT_QUANT", bool(act_quant)), ("PAD_MASK", pad_mask)))


def _fetch_params(arena: UniformArena, g: Needle3Geometry, tables: CQPack, site: int, positions: int) -> Binding:
    if len(g.engram_orders) > MAX_ORDERS or g.num_engram_tables > MAX_TABLES:
        raise UnsupportedModelError(f"engram: {len(g.engram_orders)} orders / {g.num_engram_tables} tables "
                                    f"(at most {MAX_ORDERS} / {MAX_TABLES})")
    if not 0 < g.engram_slots < 1 << 31:
        raise UnsupportedModelError(f"engram: {g.engram_slots} slots per table")
    if tables.rows != g.num_engram_tables * g.engram_slots or tables.cols != g.engram_sub_dim:
        raise UnsupportedModelError(f"{tables.name}: {tables.rows}x{tables.cols}, expected "
                                    f"{g.num_engram_tables * g.engram_slots}x{g.engram_sub_dim}")
    if len(tables.slices) != 1:
        raise DeviceLimitError(f"{tables.name}: one site's tables must fit one storage binding "
                               f"({len(tables.slices)} slices); raise maxStorageBufferBindingSize")
    width = g.num_engram_tables * g.engram_sub_dim
    out_pad = -(-width // tables.group) * tables.group
    orders = list(g.engram_orders) + [0] * (MAX_ORDERS - len(g.engram_orders))
    return arena.struct("engram", "FetchParams", positions=positions, width=width, out_pad=out_pad,
                        sub_dim=g.engram_sub_dim, row_pad=tables.in_pad, row_words=tables.row_words,
                        groups=tables.groups, norm_base=tables.rows * tables.row_words, slots=g.engram_slots,
                        heads=g.engram_heads, seed_stride=g.engram_seed_heads or g.engram_heads,
                        num_orders=len(g.engram_orders), site=site, orders=orders)


def fetch(plan: Plan, arena: UniformArena, step, *, geometry: Needle3Geometry, site: int, tables: CQPack, levels,
          tokens, eh, positions: int, act_quant: bool = False, pad_mask: bool = False) -> None:
    """eh[site][t] = prepare_input(e_p) for p = pos0 + t (§4.2, §5.5.1), one site per call;
    ``act_quant`` (deploy numerics) prepares A8(e_p) instead (§4.9 point 1).

    e_p is the concatenation over tables tb = oi·H + h of the first sub_dim values of the
    dequantised row tb·slots + slot(p, tb) of this site's ``tables`` pack, or zeros while
    p < order(tb) - 1. The hash reads the raw u32 ids (§0 item 1) of ``tokens`` at p - j
    (ids before position 0 count as 0). Bindings (``engram.wgsl``, entry ``fetch``): 0 params,
    1 ``step`` (uniform Step), 2 ``tokens`` u32 [context], 3 the site's tables pack (one slice),
    4 ``levels``, 5 ``eh`` f32 [sites][T][pad(tables·sub_dim)]. Workgroups: (T,), 256
    invocations. Constants: CODE_BITS, LEVEL_BASE, GROUP, CAP, FWHT_SCALE, MAX_TABLES, PAD_MASK
    (``pad_mask``: also zeros where the n-gram's oldest id is the pad id 0, §U a).
    A dispatch per site keeps each dispatch at 4 storage buffers whatever the number of sites.
    """
    params = _fetch_params(arena, geometry, tables, site, positions)
    plan.add(_fetch_key(geometry, tables, "fetch", act_quant, pad_mask),
             [params, step, tokens, Binding(tables.slices[0].buffer), levels, eh], (positions,),
             label=f"engram fetch {site}")


def hashes(plan: Plan, arena: UniformArena, step, *, geometry: Needle3Geometry, tables: CQPack, tokens, slots,
           positions: int) -> None:
    """Diagnostic: slots[t][tb] = the §4.2 slot index at p = pos0 + t, bit 31 set while invalid.

    Bindings (``engram.wgsl``, entry ``hashes``): 0 params, 1 ``step``, 2 ``tokens``, 3 ``slots``
    u32 [T][tables]. Workgroups: (T,), 64 invocations. Same hash code as ``fetch``.
    """
    params = _fetch_params(arena, geometry, tables, 0, positions)
    plan.add(_fetch_key(geometry, tables, "hashes"), [params, step, tokens, slots], (positions,),
             label="engram hashes")


def ring_slots_needed(geometry: Needle3Geometry, positions: int) -> int:
    """Smallest ring for chunks of ``positions``: no slot read by a chunk is written by it."""
    g = geometry
    return positions + (g.engram_conv_taps - 1) * g.engram_conv_dilation


def conv(plan: Plan, arena: UniformArena, step, *, geometry: Needle3Geometry, fp16_store: Fp16Store, ekv, ring,
         ring_size: int, ev, positions: int, stored_sites: tuple | None = None, pad_tokens=None) -> None:
    """ev[t][s] = Σ_j taps_s[j] ⊙ Vraw[s, p - j·dilation] for every site s (§4.2, §6 item 3).

    Tap j is skipped when j·dilation > p or p < j·max_order (both conditions of §4.2). Vraw of
    positions >= pos0 is read from ``ekv`` f32 [T][sites·2d] (per site K then Vraw, the
    cq_matmul output); older positions from ``ring`` f32 [sites][ring_size][d] at slot
    position mod ring_size. Each invocation then stores its own Vraw into the ring, which is
    race-free because ring_size >= T + (taps - 1)·dilation (asserted here).
    Bindings (``engram.wgsl``, entry ``conv``): 0 params, 1 ``step``, 2 ``fp16`` (taps
    ``engram.{s}.taps`` [taps][d]), 3 ``ekv``, 4 ``ring``, 5 ``ev`` f32 [T][sites][d], 6
    ``pad_tokens`` u32 [context] when given (PAD_MASK: tap j skipped where the id at
    p - j·max_order is the pad id 0, §U a; otherwise ``ekv`` is bound again and never read).
    Workgroups: (ceil(d/256), T, sites), 256 invocations, one invocation per channel.
    ``stored_sites[s]``: the stored site whose taps site s uses (default s; a rung of elastic
    depth runs only its kept sites, §U f).
    """
    g = geometry
    sites, d = len(g.engram_sites), g.d_model
    stored_sites = tuple(range(sites)) if stored_sites is None else tuple(stored_sites)
    if sites == 0:
        return
    if sites > MAX_SITES:
        raise UnsupportedModelError(f"engram: {sites} sites (at most {MAX_SITES})")
    need = ring_slots_needed(g, positions)
    if ring_size < need:
        raise DeviceLimitError(f"engram ring of {ring_size} slots is too small for chunks of {positions} "
                               f"(needs {need} = T + (taps - 1)·dilation)")
    window = fp16_store.window([f"engram.{s}.taps" for s in stored_sites])
    taps_at = [window.offset(f"engram.{s}.taps") for s in stored_sites]
    taps_at += [0] * (MAX_SITES - sites)
    # The module's fetch constants must be defined to compile; conv does not depend on them.
    key = KernelKey("engram", entry="conv", consts=(
        ("CODE_BITS", 2), ("LEVEL_BASE", 0), ("GROUP", 128), ("CAP", 256), ("FWHT_SCALE", fwht_scale(128)),
        ("MAX_TABLES", MAX_TABLES), ("ACT_QUANT", False), ("PAD_MASK", pad_tokens is not None)))
    params = arena.struct(key, "ConvParams", d=d, taps=g.engram_conv_taps, dilation=g.engram_conv_dilation,
                          max_order=g.engram_max_order, ring_slots=ring_size, ekv_stride=sites * 2 * d,
                          site_stride=2 * d, value_offset=d, sites=sites, taps_at=taps_at)
    plan.add(key, [params, step, window.binding, ekv, ring, ev, ekv if pad_tokens is None else pad_tokens],
             (-(-d // 256), positions, sites), label="engram conv")
