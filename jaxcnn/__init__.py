"""jaxcnn: train CNNs on one device, many devices and many hosts; measure which layout pays."""

__version__ = "0.1.0"
