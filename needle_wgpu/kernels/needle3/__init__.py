"""Needle 3's own fused ops (embedding, Engram, mHC, the Kronecker MLP, probe heads) and the FP16
parameter store they read; the ops both families share live one level up."""
