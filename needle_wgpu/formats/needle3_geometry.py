"""Needle 3 geometry: one frozen dataclass, read from the .cact header and validated once (§2, §8)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ContainerError

MAX_DIM = 1 << 20


def kron_blocks(n: int) -> tuple:
    """Kronecker block sizes of the HadaMLP (§4.6): ba = 1 << (bitlen(n-1) // 2), bb = n / ba."""
    ba = 1 << ((n - 1).bit_length() // 2)
    return ba, n // ba


@dataclass(frozen=True)
class Needle3Geometry:
    vocab: int
    out_vocab: int
    d_model: int
    num_heads: int
    num_kv_heads: int
    num_layers: int
    qk_head_dim: int
    v_head_dim: int
    max_seq_len: int
    hada_n: int
    mhc_lanes: int
    sliding_window: int
    global_layers: tuple
    qkv_conv_taps: int
    engram_slots: int
    engram_sub_dim: int
    num_engram_tables: int
    engram_conv_taps: int
    engram_conv_dilation: int
    engram_seed_heads: int
    engram_orders: tuple
    engram_sites: tuple
    rope_theta: float
    kv_window: int = 0
    kv_bits: int = 0

    # ------------------------------------------------------------------ derived widths (§2)
    @property
    def head_rows(self) -> int:
        """Rows of the tied head (§4.8): out_vocab, or the whole vocab when it is 0."""
        return self.out_vocab or self.vocab

    @property
    def kv_repeat(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.qk_head_dim

    @property
    def k_dim(self) -> int:
        return self.num_kv_heads * self.qk_head_dim

    @property
    def v_dim(self) -> int:
        return self.num_kv_heads * self.v_head_dim

    @property
    def attn_out(self) -> int:
        return self.num_heads * self.v_head_dim

    @property
    def mhc_width(self) -> int:
        return self.mhc_lanes * self.d_model

    @property
    def kron_a(self) -> int:
        return kron_blocks(self.hada_n)[0]

    @property
    def kron_b(self) -> int:
        return kron_blocks(self.hada_n)[1]

    @property
    def engram_heads(self) -> int:
        return self.num_engram_tables // len(self.engram_orders) if self.engram_orders else 0

    @property
    def engram_max_order(self) -> int:
        return max(self.engram_orders, default=1)

    @property
    def engram_width(self) -> int:
        """W = tables·sub_dim, the fetch width and the key/value projections' input (§U c)."""
        return self.num_engram_tables * self.engram_sub_dim

    def is_global(self, layer: int) -> bool:
        """Global layers attend to the whole causal past (§4.5 item 8)."""
        return layer in self.global_layers or self.sliding_window == 0

    def attention_span(self, layer: int) -> int:
        """Positions a query may see, itself included: the window, or the whole context."""
        return self.max_seq_len if self.is_global(layer) else min(self.sliding_window, self.max_seq_len)

    def engram_site(self, layer: int) -> int:
        """Index of the engram site at this layer, or -1 (§4.5 item 1)."""
        return self.engram_sites.index(layer) if layer in self.engram_sites else -1

    # ------------------------------------------------------------------ header (§8)
    @classmethod
    def from_header(cls, w: tuple) -> "Needle3Geometry":
        num_orders, num_sites = w[26], w[31]
        if num_orders > 4 or num_sites > 16:
            raise ContainerError(f"header: {num_orders} engram orders / {num_sites} sites (at most 4 / 16)")
        mask = w[17] | (w[18] << 32)
        geometry = cls(
            vocab=w[5], out_vocab=w[6], d_model=w[7], num_heads=w[8], num_kv_heads=w[9],
            num_layers=w[10], qk_head_dim=w[11], v_head_dim=w[12], max_seq_len=w[13],
            hada_n=w[14], mhc_lanes=w[15], sliding_window=w[16],
            global_layers=tuple(i for i in range(64) if mask >> i & 1),
            qkv_conv_taps=w[19], engram_slots=w[20], engram_sub_dim=w[21],
            num_engram_tables=w[22], engram_conv_taps=w[23], engram_conv_dilation=w[24],
            engram_seed_heads=w[25], engram_orders=tuple(w[27 : 27 + num_orders]),
            engram_sites=tuple(w[32 : 32 + num_sites]), rope_theta=float(w[48]),
            kv_window=w[3], kv_bits=w[4],
        )
        geometry.validate()
        return geometry

    def header_words(self, num_tensors: int, codebook_len: int = 28) -> tuple:
        mask = sum(1 << i for i in self.global_layers)
        orders = list(self.engram_orders) + [0] * (4 - len(self.engram_orders))
        sites = list(self.engram_sites) + [0] * (16 - len(self.engram_sites))
        return (0x05E12A84, num_tensors, codebook_len, self.kv_window, self.kv_bits, self.vocab,
                self.out_vocab, self.d_model, self.num_heads, self.num_kv_heads, self.num_layers,
                self.qk_head_dim, self.v_head_dim, self.max_seq_len, self.hada_n, self.mhc_lanes,
                self.sliding_window, mask & 0xFFFFFFFF, mask >> 32, self.qkv_conv_taps,
                self.engram_slots, self.engram_sub_dim, self.num_engram_tables,
                self.engram_conv_taps, self.engram_conv_dilation, self.engram_seed_heads,
                len(self.engram_orders), *orders, len(self.engram_sites), *sites, self.rope_theta)

    def validate(self) -> None:
        def bad(problem):
            raise ContainerError(f"header: {problem}")

        positive = dict(vocab=self.vocab, d_model=self.d_model, num_heads=self.num_heads,
                        num_kv_heads=self.num_kv_heads, num_layers=self.num_layers,
                        qk_head_dim=self.qk_head_dim, v_head_dim=self.v_head_dim,
                        max_seq_len=self.max_seq_len, hada_n=self.hada_n, mhc_lanes=self.mhc_lanes)
        for name, value in positive.items():
            if not 0 < value <= MAX_DIM:
                bad(f"{name} = {value} is out of range (1..{MAX_DIM})")
        if self.num_layers > 64:
            bad(f"num_layers = {self.num_layers} (at most 64: the global mask has 64 bits)")
        if self.out_vocab > self.vocab:
            bad(f"out_vocab {self.out_vocab} > vocab {self.vocab}")
        if self.num_heads % self.num_kv_heads:
            bad(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
        if self.qk_head_dim % 2:
            bad(f"qk_head_dim {self.qk_head_dim} is odd (RoPE pairs halves)")
        if self.d_model > self.hada_n:
            bad(f"d_model {self.d_model} > hada_n {self.hada_n}")
        ba, bb = kron_blocks(self.hada_n)
        if ba * bb != self.hada_n:
            bad(f"hada_n {self.hada_n} does not split into Kronecker blocks")
        if self.sliding_window > MAX_DIM or self.qkv_conv_taps > 64:
            bad(f"sliding_window {self.sliding_window} / qkv_conv_taps {self.qkv_conv_taps} out of range")
        if any(layer >= self.num_layers for layer in self.global_layers):
            bad(f"global layer mask names layers past num_layers {self.num_layers}")
        if not (self.rope_theta == self.rope_theta and 1.0 <= self.rope_theta < 1e12):
            bad(f"rope_theta {self.rope_theta} is not a usable base")
        self._validate_engram(bad)

    def _validate_engram(self, bad) -> None:
        orders, sites = self.engram_orders, self.engram_sites
        if not orders:
            if sites or self.num_engram_tables:
                bad("engram sites or tables without engram orders")
            return
        # A model without Engram has no sites, while the header still carries the orders,
        # tables, sub_dim, slots, taps and dilation (§U c): those are checked all the same.
        if any(not 1 <= o <= 8 for o in orders):
            bad(f"engram orders {orders} out of range 1..8")
        if len(set(sites)) != len(sites) or any(s >= self.num_layers for s in sites):
            bad(f"engram sites {sites} repeat or name layers past num_layers {self.num_layers}")
        if list(sites) != sorted(sites):
            bad(f"engram sites {sites} are not ascending")
        if self.num_engram_tables == 0 or self.num_engram_tables % len(orders):
            bad(f"{self.num_engram_tables} engram tables do not divide into {len(orders)} orders")
        for name, value in (("engram_slots", self.engram_slots), ("engram_sub_dim", self.engram_sub_dim),
                            ("engram_conv_taps", self.engram_conv_taps)):
            if not 0 < value <= MAX_DIM:
                bad(f"{name} = {value} is out of range (1..{MAX_DIM})")
        if self.engram_conv_dilation > 64 or self.engram_conv_taps > 64:
            bad("engram conv taps/dilation out of range (at most 64)")
        # §U c: sub_dim = d // (orders·heads); the fetch width tables·sub_dim may fall short of d.
        if self.engram_sub_dim != self.d_model // self.num_engram_tables:
            bad(f"engram_sub_dim {self.engram_sub_dim} != d_model // tables = "
                f"{self.d_model // self.num_engram_tables}")
        if self.num_engram_tables * self.engram_slots > MAX_DIM * 16:
            bad(f"{self.num_engram_tables} x {self.engram_slots} engram rows is absurd")
