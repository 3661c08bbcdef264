"""Differentiable ops, one module per family; each op keeps its backward rule beside it."""
