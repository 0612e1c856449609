"""Int8 quantization: the ``w8a16`` / ``w8a8`` schemes, the checkpoint formats that carry them
(msModelSlim's, compressed-tensors'), and ``mindie-host quantize``."""
