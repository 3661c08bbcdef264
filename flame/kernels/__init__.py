"""Every ``@triton.jit`` of flame, one file per family. Importing any of them imports this package
first, which imports the files whose kernels are tunable: each registers its kernels' specs
(``flame.tune.register``) at import, so ``flame.tune.SPECS`` is complete before any launcher asks
for a config or a tuning table is read."""
from . import attention, conv2d, elementwise, matmul, norms, reduce, softmax
