"""Inference: ONNX export, onnxruntime sessions, prototype-space extraction behind one interface, and
`protofl-edge predict` (onnxruntime alone)."""
