"""The dense GGUF architectures the engine serves, one row each (spec dense-gguf.md §1-§3).
Pure Python.

Everything the engine does differently per architecture is a field of `ArchRules`: the
geometry's checks and tensor list (`formats/dense_geometry.py`), the GPU graph
(`models/dense.py`) and the synthetic test files (`synth_gguf.py`) read the row of
`ARCHITECTURES` and never test the architecture's name. Adding an architecture is one row here
(plus its tests) as long as it needs no new kind of rule.

The NumPy reference keeps its own table (`reference/dense.py`, `ArchRules` / `ARCHITECTURES`) on
purpose: an oracle that imported this one would agree with a wrong row. The two are written
independently and `tests/test_dense_archs.py` checks that they agree on every fact both hold;
the llama.cpp parity tests check both against llama.cpp.
"""

from __future__ import annotations

from dataclasses import dataclass

ROPE_SCALINGS = ("none", "linear", "yarn")  # the rope.scaling.type values every row accepts


@dataclass(frozen=True)
class ArchRules:
    """What one architecture changes in the §1 keys, the §2 tensors and the §3 graph."""

    models: str = ""                  # the model families whose GGUF files carry this architecture (the docs'
                                      # supported list, `supported_markdown`)
    rope_style: str = "neox"          # "neox" pairs (x_j, x_{j+n/2}); "adjacent" pairs (x_2j, x_2j+1) (llama)
    qk_norm: str | None = None        # "head": one [key_dim] RMSNorm weight shared by the heads (qwen3);
                                      # "full": over the whole q / k row before the head split (olmoe)
    qkv_bias: str | None = None       # attn_{q,k,v}.bias "required" (qwen2), "optional" (read when
                                      # blk.0 has them: llama), or None (not part of the graph)
    output_bias: bool = False         # output.bias [vocab] is read when the file has it (qwen2)
    tied_head: bool = True            # the usual files have no output.weight (synth_gguf's default)
    output_required: bool = False     # output.weight must be present: no tied head (olmoe)
    rms_eps: float = 1e-6             # the usual files' layer_norm_rms_epsilon (synth_gguf's default)
    gqa: bool = True                  # llama.cpp loads head_count_kv < head_count (its olmoe loader does not)
    activation: str = "silu"          # the gated FFN's: "silu" or "gelu_tanh" (gemma3)
    moe: bool = False                 # the FFN is routed experts (§2 ffn_*_exps, §3 MoE)
    expert_width_key: str | None = None  # MoE: the key of one expert's width when it is not
                                         # feed_forward_length (qwen3moe; default ff / used)
    renormalise: bool = False         # MoE: the top-k weights divided by their sum (qwen3moe, not olmoe)
    embedding_scale: bool = False     # x = embedding row · sqrt(d) (gemma3)
    post_norms: bool = False          # RMSNorm of the attention and FFN outputs before each residual add
    pre_norms: bool = True            # attn_norm / ffn_norm before each sublayer; False: the sublayers read
                                      # the residual stream itself and the file has neither (olmo2)
    sliding_every: int = 0            # n > 0: layer il is global when il % n == n − 1, else sliding
                                      # (attention.sliding_window wide)
    local_rope_base: float = 0.0      # the sliding layers' RoPE base, unscaled (not in the file; §1); 0: the
                                      # global layers' RoPE on every layer (gemma2)
    d_query_scale_layers: int = 0     # a model of exactly this many layers scales queries by
                                      # 1/sqrt(d / n_head), not 1/sqrt(key_length) (Gemma 3 27B, §3)
    rope_scalings: tuple = ROPE_SCALINGS  # the rope.scaling.type values accepted
    rope_factor_tensors: tuple = ()   # model-wide [rope_dims / 2] frequency-factor tensors read when
                                      # present: ("rope_freqs",) Llama 3; (long, short) LongRoPE (phi3)
    fused_qkv: bool = False           # blk.N.attn_qkv [q | k | v] instead of attn_q/k/v (phi3)
    fused_gate_up: bool = False       # blk.N.ffn_up holds [gate | up] and there is no ffn_gate (phi3)
    nope_every: int = 0               # n > 0: layer il has no RoPE when (il + 1) % n == 0 (smollm3: 4;
                                      # llama.cpp's n_no_rope_layer_step, fixed per architecture, not in the file)
    declared_window: str = "ignored"  # attention.sliding_window of a row without sliding layers:
                                      # "ignored" as llama.cpp ignores it (llama; a warning says so), or
                                      # "refused" where llama.cpp would apply a pattern not implemented
                                      # here (olmo2: OLMo 3's sliding layers)
    softcaps: tuple = ()              # (attention, final) logit soft-capping, llama.cpp's defaults of
                                      # attn_logit_softcapping / final_logit_softcapping (gemma2: 50, 30):
                                      # s = tanh(s / cap) · cap on the scores and on the logits
    short_conv: bool = False          # lfm2: a layer whose attention.head_count_kv entry is 0 is a gated short
                                      # convolution block (shortconv.in_proj / conv / out_proj, shortconv.l_cache
                                      # taps) instead of attention
    output_norm: str = "output_norm"  # the final norm's tensor stem (lfm2: token_embd_norm, as llama.cpp names it)
    multipliers: bool = False         # granite: embedding_scale, residual_scale, attention.scale (0 or absent:
                                      # none) and logit_scale (required) scale the embedding rows, each
                                      # sublayer's output before its residual add, the scores and the logits (÷)


ARCHITECTURES = {
    "llama": ArchRules(models="Llama 1-3 (Llama 3's frequency factors), SmolLM2, Mistral-style files", rope_style="adjacent", qkv_bias="optional", rms_eps=1e-5, rope_factor_tensors=("rope_freqs",)),
    "qwen2": ArchRules(models="Qwen2, Qwen2.5", qkv_bias="required", output_bias=True, tied_head=False),
    "qwen3": ArchRules(models="Qwen3", qk_norm="head"),
    "qwen3moe": ArchRules(models="Qwen3-MoE", qk_norm="head", moe=True, expert_width_key="expert_feed_forward_length",
                          renormalise=True),
    "olmoe": ArchRules(models="OLMoE", qk_norm="full", tied_head=False, output_required=True, gqa=False, moe=True),
    # §3 "Gemma 3": llama.cpp's src/models/gemma3.cpp; the local base is hard-coded there.
    "gemma3": ArchRules(models="Gemma 3", qk_norm="head", activation="gelu_tanh", embedding_scale=True, post_norms=True,
                        sliding_every=6, local_rope_base=10000.0, d_query_scale_layers=62),
    # llama.cpp's src/models/gemma2-iswa.cpp: gemma3's frame without q/k norms, every other layer
    # sliding (same RoPE), scores and logits soft-capped; the 27B (46 layers) scales by d / n_head.
    "gemma2": ArchRules(models="Gemma 2", activation="gelu_tanh", embedding_scale=True, post_norms=True, sliding_every=2,
                        d_query_scale_layers=46, softcaps=(50.0, 30.0)),
    # llama.cpp's src/models/phi3.cpp: fused q | k | v and gate | up, LongRoPE's factors by context.
    "phi3": ArchRules(models="Phi-3, Phi-3.5, Phi-4-mini", rms_eps=1e-5, output_bias=True, rope_scalings=(*ROPE_SCALINGS, "longrope"),
                      rope_factor_tensors=("rope_factors_long", "rope_factors_short"), fused_qkv=True,
                      fused_gate_up=True),
    # llama.cpp's src/models/smollm3.cpp: the llama graph, every 4th layer without RoPE.
    "smollm3": ArchRules(models="SmolLM3", rope_style="adjacent", qkv_bias="optional", nope_every=4),
    # llama.cpp's src/models/granite.cpp: llama's graph and four multipliers from the file.
    "granite": ArchRules(models="Granite 3", rope_style="adjacent", rms_eps=1e-5, rope_factor_tensors=("rope_freqs",), multipliers=True),
    # llama.cpp's src/models/olmo2.cpp: no pre-norms, post-norms, full-width q/k norms, untied head.
    "olmo2": ArchRules(models="OLMo 2", qk_norm="full", tied_head=False, output_required=True, post_norms=True, pre_norms=False,
                       declared_window="refused"),
    # llama.cpp's src/models/lfm2.cpp: short-convolution blocks mixed with GQA attention layers
    # (per-head q/k norms); the final norm is token_embd_norm.
    "lfm2": ArchRules(models="LFM2", qk_norm="head", rms_eps=1e-5, short_conv=True, output_norm="token_embd_norm",
                      declared_window="refused"),
}


def supported_markdown(tensor_types: tuple) -> str:
    """The supported architectures and tensor types as the docs list them (README.md and
    docs/api.md hold this text between ``<!-- supported: ... -->`` markers; tests/test_dense_archs.py
    checks that they do): one line per row of ``ARCHITECTURES``, in its order."""
    lines = ["| `general.architecture` | models | RoPE scaling |", "|---|---|---|"]
    for name, rules in ARCHITECTURES.items():
        scalings = ", ".join(rules.rope_scalings)
        if rules.rope_factor_tensors:
            scalings += "; " + " / ".join(f"`{stem}`" for stem in rules.rope_factor_tensors)
        lines.append(f"| `{name}` | {rules.models} | {scalings} |")
    lines += ["", "Tensor types, served in their own bits: " + ", ".join(tensor_types) + "."]
    return "\n".join(lines)
