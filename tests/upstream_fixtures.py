"""The containers written by upstream's own exporter, with upstream's logits and head outputs
(tests/fixtures/upstream/README.md): shared by the reference and the GPU tests."""

import json
import math
from pathlib import Path

import numpy as np

UPSTREAM = Path(__file__).resolve().parent / "fixtures" / "upstream"
NAMES = ("small", "small-allheads", "small-rung3")
SEQUENCES = ("len1", "len7", "len40", "len100")


def upstream_file(name: str) -> Path:
    return UPSTREAM / f"{name}.cact"


def oracle(name: str) -> dict:
    upstream_file(name)
    with np.load(UPSTREAM / f"{name}.oracle.npz") as z:
        out = {key: z[key] for key in z.files}
    # Not every npz repeats the ids; FILE.ids.json always holds them.
    ids = json.loads((UPSTREAM / f"{name}.ids.json").read_text())
    for seq in SEQUENCES:
        if f"{seq}.ids" in out:
            assert out[f"{seq}.ids"].tolist() == ids[seq]
        out[f"{seq}.ids"] = np.array(ids[seq], dtype=np.int32)
    return out


def assert_matches_oracle(model, name: str) -> None:
    """Every sequence of fixture ``name``: the model's logits within 1e-4 of the RMS of
    upstream's, no argmax mismatch, and the confidence logit within 1e-4."""
    z = oracle(name)
    for seq in SEQUENCES:
        ids = z[f"{seq}.ids"].tolist()
        rel, mismatches = logit_error(np.array(model.logits(ids)), z[f"{seq}.logits"])
        assert rel <= 1e-4 and mismatches == 0, (name, seq, rel, mismatches)
        p = model.confidence(ids)
        assert abs(math.log(p / (1 - p)) - float(z[f"{seq}.confidence"])) <= 1e-4, (name, seq)


def logit_error(got: np.ndarray, want: np.ndarray) -> tuple:
    """(max |Δ| / RMS(want), argmax mismatches) of two [T, rows] logit arrays."""
    rms = float(np.sqrt(np.mean(want.astype(np.float64) ** 2)))
    return float(np.max(np.abs(got - want)) / rms), int(np.sum(got.argmax(-1) != want.argmax(-1)))


# ----------------------------------------------------------------------------------- variants
# Valid containers upstream's format allows and its exporter does not write (§U b, c): built
# from small.cact by re-encoding or replacing records, then read back by our reader.


def variant(kind: str) -> bytes:
    """small.cact changed one way (``kind``):

    * ``mixed``: every CQ width (1, 2, 3, 4, ternary) mixed inside layer 0's q/k/v/gate, across
      the three mHC matrices and between the Engram key and value projections;
    * ``no-engram``: the Engram sites and records removed (orders, tables, slots kept);
    * ``wide-sub``: one order, one head: one table of sub_dim 256 = two CQ groups per row;
    * ``narrow-fetch``: orders (2, 3, 4), one head each: sub_dim 85, fetch width W = 255 < d;
    * ``odd-heads``: all three heads with their own probe and query counts (k 3, 1, 5; q 2, 1, 3)
      and an embedding of 5, the router's calibration (0.8, 0.1, 0.5).
    """
    from dataclasses import replace

    from needle_wgpu.formats import cact
    from needle_wgpu.formats.cact_writer import Record, records_of, write_cact
    from needle_wgpu.formats.cq_codec import cq_decode_tensor

    f = cact.load(upstream_file("small"))
    g, book = f.geometry, f.codebook
    records = records_of(f)

    def recode(name, bits):
        t = f[name]
        return Record.cq(name, cq_decode_tensor(t, book), bits, t.group, book)

    def at(name):
        return next(i for i, r in enumerate(records) if r.name == name)

    if kind == "mixed":
        widths = {"layers.0.q_proj": 1, "layers.0.k_proj": 2, "layers.0.v_proj": 3, "layers.0.gate_proj": 5,
                  "layers.1.out_proj": 2, "mhc.phi_pre": 2, "mhc.phi_post": 5, "mhc.phi_res": 3,
                  "engram.0.key_proj": 3, "engram.0.value_proj": 1, "engram.1.tables": 2,
                  "heads.0.query": 2, "heads.0.proj": 1}
        for name, bits in widths.items():
            records[at(name)] = recode(name, bits)
        return write_cact(g, records, book)
    rng = np.random.default_rng(7)
    if kind == "odd-heads":
        return write_cact(g, _odd_heads(g, [r for r in records if not r.name.startswith("heads.")], book, rng), book)
    if kind == "no-engram":
        g2 = replace(g, engram_sites=())
        return write_cact(g2, [r for r in records if not r.name.startswith("engram.")], book)
    orders = {"wide-sub": (2,), "narrow-fetch": (2, 3, 4)}[kind]
    tables = len(orders)
    sub = g.d_model // tables
    g2 = replace(g, engram_orders=orders, num_engram_tables=tables, engram_sub_dim=sub,
                 engram_conv_dilation=max(orders))
    out = []
    for r in records:
        if r.name.endswith(".tables"):
            r = Record.cq(r.name, rng.normal(0, 0.5, (tables * g.engram_slots, sub)), 4, 128, book)
        elif r.name.endswith("_proj") and r.name.startswith("engram."):
            r = Record.cq(r.name, rng.normal(0, 0.06, (g.d_model, tables * sub)), 4, 128, book)
        out.append(r)
    return write_cact(g2, out, book)


def _odd_heads(g, records, book, rng):
    from needle_wgpu.formats.cact_writer import Record

    tokenizer = records.pop() if records[-1].name == "tokenizer" else None
    cells, d = g.num_layers + 1, g.d_model
    out = records + [Record.fp16("heads.manifest", [1.0, 2.0, 3.0])]
    for h, (k, q, width) in enumerate(((3, 2, 5), (1, 1, 1), (5, 3, 3))):
        p = f"heads.{h}."
        out += [Record.cq(p + "probes", rng.normal(0, 1, (cells * k, d)), 4, 128, book),
                Record.fp16(p + "gain", rng.uniform(0.5, 1.5, (cells, k))),
                Record.cq(p + "query", rng.normal(0, 1, (q, d)), 4, 128, book),
                Record.fp16(p + "row_bias", rng.normal(0, 0.5, (q, cells, k))),
                Record.cq(p + "proj", rng.normal(0, 0.1, (width, q * d)), 4, 128, book),
                Record.fp16(p + "bias", np.zeros(width) if h == 0 else rng.normal(0, 0.5, width))]
        if h == 2:
            out.append(Record.fp16(p + "calibration", [0.8, 0.1, 0.5]))
    return out + ([tokenizer] if tokenizer is not None else [])
