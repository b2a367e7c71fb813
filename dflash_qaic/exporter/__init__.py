"""Export to ONNX programs and an artifacts directory (`dflash-export`; in Python
`dflash_qaic.export(...)`, defined in dflash_qaic/api.py)."""
