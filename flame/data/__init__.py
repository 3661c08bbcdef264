"""Training data: the latent cache (format, writer, reader), several caches as one set, the bucketed
loader, aspect buckets and a synthetic cache for demos and tests."""
from .buckets import fit_to_bucket, make_buckets, nearest_bucket
from .cache import Batch, CacheError, CacheNotFoundError, CacheWriter, LatentCache
from .loader import BucketBatchLoader, part_bounds
from .sets import CacheSet
from .synthetic import write_synthetic_cache, write_synthetic_cache_for
