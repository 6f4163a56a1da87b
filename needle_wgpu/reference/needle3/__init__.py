"""The NumPy reference of Needle 3 (spec needle3.md), one module per part of the model:
``model.ReferenceModel`` strings them together."""
