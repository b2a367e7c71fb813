"""The compiler step (profiles, compiler inputs, command lines, QPC cache); in Python
`dflash_qaic.compile(...)`, defined in dflash_qaic/api.py."""
