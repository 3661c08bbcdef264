"""Neural-network building blocks; ``flame.nn.functional`` holds the functional ops."""
from . import functional
