"""Matmul ops. Placeholder until implemented."""


def matmul(a, b):
    raise NotImplementedError


def bmm(a, b):
    raise NotImplementedError
