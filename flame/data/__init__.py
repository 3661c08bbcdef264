"""Training data: the latent cache (format, writer, reader), image folders scanned and encoded into
caches (built or refreshed), several caches as one set, the bucketed loader, aspect buckets and a
synthetic cache for demos and tests."""
from .buckets import BUCKET_UNIT, fit_to_bucket, make_buckets, nearest_bucket
from .cache import Batch, CacheError, CacheNotFoundError, CacheWriter, LatentCache
from .images import (
    BAD_IMAGES,
    IMAGE_EXTS,
    CachePlan,
    CacheSettings,
    DatasetError,
    ImageItem,
    ImageSet,
    build_or_refresh_cache,
    plan_cache,
    scan_dataset,
    write_cache,
)
from .loader import BucketBatchLoader, part_bounds
from .sets import CacheSet
from .synthetic import write_synthetic_cache, write_synthetic_cache_for
