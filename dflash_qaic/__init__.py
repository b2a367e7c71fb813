"""dflash-qaic: DFlash speculative decoding for Qualcomm Cloud AI 100."""

__version__ = "0.1.0"
