"""Trace to ONNX, check graphs, write the artifacts directory."""
