"""jaxcnn: train CNNs on one device, many devices and many hosts; measure which layout pays."""

from jaxcnn.host_memory import keep_freed_memory

__version__ = "0.1.0"

# Before JAX starts its thread pools, or XLA:CPU page-faults every step's buffers back in
# (jaxcnn.host_memory says why).
keep_freed_memory()
