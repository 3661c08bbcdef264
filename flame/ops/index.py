"""Index ops (gather, index_select, embedding). Placeholder until implemented."""


def gather(x, dim, index):
    raise NotImplementedError


def index_select(x, dim, index):
    raise NotImplementedError


def embedding(index, weight):
    raise NotImplementedError
